"""`loongforge bench serve`: round-trip latency of `get_action` through the policy server, by recipe,
batch and concurrent clients, split into where the server spends it; and what the flow's steps and
the K-sample mean cost the model.

    loongforge bench serve [--recipes tiny small] [--batches 1 8] [--clients 1 4] [--requests 30]
                           [--device cpu|cuda] [--steps 4] [--samples 1]

Per recipe: a freshly initialised model of that recipe (latency does not depend on the weights) on a
synthetic shard root of 2 cameras at --image-size, behind the real server (server.py, its own thread
here, real TCP on loopback) and the real backend (backend.py: GR00T's observation layout -> Policy).
Clients are separate processes (benchmarks/micro/serve_load.py, loongforge's PolicyClient): one sends
--warmup requests first (untimed: the server's first calls are slow), then each of --clients sends one
untimed request, waits until all have, and sends --requests timed ones back to back; with several
clients the REP socket answers one request at a time, so their queueing shows in the round trip.

Per row: p50 / p95 / p99 of the client's round trip, and the server's medians of
  decode     the frame -> msgpack -> token -> arrays (protocol.py)
  preprocess the backend's checks, tensors, normalisation, prompt tokens (Policy.batch)
  model      the flow: `samples` x (backbone + `steps` Euler steps of the action head), the mean, per-key split
  encode     the reply frame
and `other` = p50 round trip - the server's p50 sum (transport, the client's own encode/decode, queueing).
Flow: the model's median at (steps 1, samples 1), (4, 1) and (4, 8), in-process, batch 1: the
share of the 4-step model time spent in the 3 extra steps, and the share of the 8-sample model time
that the K-sample mean adds over one sample.

Writes results/serve/serve-<stamp>.json and .txt with the load average before and after. CPU figures
taken beside other work are indicative only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.config import DataConfig, RunConfig, TrainConfig
from loongforge.train.data.training_data import load_training_data
from loongforge.train.eval.policy import Policy
from loongforge.train.model.build import build_model
from loongforge.train.recipes import plan_model
from loongforge.train.serve.backend import Defaults, PolicyBackend
from loongforge.train.serve.server import PolicyServer, ServeConfig

CAMERAS = ("front", "wrist")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipes", nargs="+", default=["tiny", "small"], help="tiny, small, gr00t-n1.6 (full size)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=30, help="timed requests per client and row")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests before each row")
    p.add_argument("--steps", type=int, default=4, help="Euler steps of the flow (N1.6: 4)")
    p.add_argument("--samples", type=int, default=1, help="flow samples averaged per action in the rows "
                   "(1: what Isaac-GR00T serves; the K-sample mean's cost is in the flow section)")
    p.add_argument("--image-size", type=int, default=224, help="camera frames are this square size")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the server (default: torch's; "
                   "1 on a machine shared with other work, where spinning OpenMP threads distort the figures)")
    p.add_argument("--out", default=os.path.join(str(RESULTS_DIR), "serve"))
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")


def handle(a: argparse.Namespace) -> int:
    device = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    if a.threads:
        torch.set_num_threads(a.threads)
    doc = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "load_average_start": list(os.getloadavg()),
           "settings": {k: getattr(a, k) for k in ("batches", "clients", "requests", "warmup", "steps", "samples",
                                                   "image_size")},
           "rows": [], "flow": []}
    with tempfile.TemporaryDirectory(prefix="loongforge-bench-serve-") as work:
        root = os.path.join(work, "shards")
        make_synthetic_root(root, lengths=(8,), height=a.image_size, width=a.image_size, cameras=CAMERAS,
                            state_dim=14, action_dim=12, action_horizon=16)
        for recipe in a.recipes:
            backend = build_backend(recipe, root, device, a.steps, a.samples)
            for batch in a.batches:
                obs_file = os.path.join(work, f"obs-{batch}.npz")
                save_observation(obs_file, backend, batch, a.image_size)
                for clients in a.clients:
                    doc["rows"].append({"recipe": recipe, "batch": batch, "clients": clients,
                                        **measure(backend, obs_file, clients, a.requests, a.warmup)})
                    print(format_row(doc["rows"][-1]), file=sys.stderr, flush=True)
            doc["flow"].append({"recipe": recipe, **flow_shares(backend, a.image_size)})
            del backend
    doc["load_average_end"] = list(os.getloadavg())
    base = write(doc, a.out)
    print(json.dumps(doc, indent=2) if a.json else format_table(doc))
    print(f"written: {base}.json, {base}.txt", file=sys.stderr)
    return 0


def build_backend(recipe: str, root: str, device: str, steps: int, samples: int):
    """The recipe's model, freshly initialised, behind PolicyBackend, as `loongforge serve` would serve
    a run of it on this root."""
    data = DataConfig(root=root)
    index = load_training_data(data)
    plan = plan_model(TrainConfig(recipe=recipe, data=data, run=RunConfig(run_dir=root)), index)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: the full-size model in seconds on a GPU
        model = build_model(plan.model)  # float32, as Policy.load serves a run today
    policy = Policy(model, plan.processor, tokenizer=plan.tokenizer, device=device, index=index)
    return PolicyBackend(policy, Defaults(steps=steps, samples=samples))


def observation(backend, batch: int, size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cfg = backend.get_modality_config()
    return {"video": {k: rng.integers(0, 256, (batch, backend.t_video, size, size, 3), dtype=np.uint8)
                      for k in cfg["video"]["modality_keys"]},
            "state": {k: rng.uniform(-1, 1, (batch, backend.t_state, d)).astype(np.float32)
                      for k, d in backend.state_keys.items()},
            "language": {cfg["language"]["modality_keys"][0]: [["pick up the red cube"]] * batch}}


def save_observation(path: str, backend, batch: int, size: int) -> None:
    """The request every client sends, as flat arrays (serve_load.py rebuilds the nested map)."""
    obs = observation(backend, batch, size)
    flat = {f"{kind}/{k}": v for kind in ("video", "state") for k, v in obs[kind].items()}
    (lang, texts), = obs["language"].items()
    np.savez(path, **flat, **{f"language/{lang}": np.array([t[0] for t in texts])})


def measure(backend, obs_file: str, clients: int, requests: int, warmup: int) -> dict:
    """One row: `clients` processes against a fresh server on `backend`."""
    server = PolicyServer(ServeConfig(port=0))
    port = int(server.endpoint.rsplit(":", 1)[1])
    thread = threading.Thread(target=server.serve_forever, args=(backend,), daemon=True)
    thread.start()
    cmd = [sys.executable, "-m", "loongforge.benchmarks.micro.serve_load", "--port", str(port), "--obs", obs_file]
    barrier = obs_file + f".go{clients}"
    try:
        # The server warms up first (its first calls pick kernels and grow the allocator: up to 100x slower
        # on CPU); then every client sends one untimed request of its own (its connection) and waits at the
        # barrier, so the server's records after it are exactly the timed requests.
        _clients([*cmd, "--requests", "0", "--warmup", str(warmup)], 1)
        procs = _start([*cmd, "--requests", str(requests), "--warmup", "1", "--barrier", barrier], clients)
        ready = lambda: sum(f.startswith(os.path.basename(barrier) + ".")  # noqa: E731
                            for f in os.listdir(os.path.dirname(barrier)))
        while ready() < clients:
            if any(p.poll() is not None for p in procs):
                break  # a client died: _finish says why
            time.sleep(0.005)
        server.timings.clear()
        open(barrier, "w").close()
        rtt = _finish(procs)
    finally:
        server.stop()
        thread.join(30)
    timed = list(server.timings)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    q = lambda p: round(1e3 * float(np.percentile(rtt, p)), 3)  # noqa: E731
    split = {k: ms([getattr(t, f"{k}_s") for t in timed]) for k in ("decode", "preprocess", "model", "encode")}
    return {"requests": len(rtt), "p50_ms": q(50), "p95_ms": q(95), "p99_ms": q(99), "server_ms": split,
            "other_ms": round(q(50) - sum(split.values()), 3)}


def _clients(cmd: list[str], n: int) -> list[float]:
    """`n` client processes at once -> all their timed round trips (seconds)."""
    return _finish(_start(cmd, n))


def _start(cmd: list[str], n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]


def _finish(procs: list[subprocess.Popen]) -> list[float]:
    outs = [p.communicate(timeout=3600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"serve_load exited {p.returncode}: {err[-2000:]}")
    return [s for out, _ in outs for s in json.loads(out)["round_trip_s"]]


def flow_shares(backend, size: int, repeats: int = 7, warmup: int = 3) -> dict:
    """Model-time medians, batch 1, at (steps, samples) = (1, 1), (4, 1), (4, 8), in-process. The three
    run in turn, round after round, so a neighbour's load falls on all of them alike; the first calls
    (kernel selection, allocator growth: up to 100x slower on CPU) are not timed."""
    obs = observation(backend, 1, size)
    configs = ((1, 1), (4, 1), (4, 8))
    prepared = {c: backend.prepare(obs, {"steps": c[0], "samples": c[1]}) for c in configs}
    times: dict = {c: [] for c in configs}
    for i in range(warmup + repeats):
        for c in configs:
            t0 = time.perf_counter()
            backend.run(prepared[c])
            if i >= warmup:
                times[c].append(time.perf_counter() - t0)
    out = {f"model_ms_steps{s}_samples{k}": round(1e3 * statistics.median(times[(s, k)]), 3) for s, k in configs}
    one, four, eight = (out[f"model_ms_steps{s}_samples{k}"] for s, k in ((1, 1), (4, 1), (4, 8)))
    out["extra_3_steps_share_of_4step"] = round(max(0.0, four - one) / four, 3)
    out["k8_mean_share_of_8sample"] = round(max(0.0, eight - four) / eight, 3)
    return out


def format_row(r: dict) -> str:
    s = r["server_ms"]
    return (f"{r['recipe']:<10} B={r['batch']:<2} clients={r['clients']}  p50 {r['p50_ms']:8.1f}  p95 "
            f"{r['p95_ms']:8.1f}  p99 {r['p99_ms']:8.1f} ms | decode {s['decode']:6.2f}  preprocess "
            f"{s['preprocess']:7.2f}  model {s['model']:8.1f}  encode {s['encode']:5.2f}  other {r['other_ms']:7.1f}")


def format_table(doc: dict) -> str:
    st = doc["settings"]
    where = doc["gpu"] or f"{doc['cpus']} CPUs"
    lines = [f"get_action round trips on {doc['device']} ({where}, {doc['torch_threads']} torch threads, float32), "
             f"{st['steps']} flow steps, {st['samples']} sample(s), 2 cameras "
             f"{st['image_size']}x{st['image_size']}, {st['requests']} requests per client; load average "
             f"{doc['load_average_start']} -> {doc['load_average_end']}",
             "server medians, ms: decode+preprocess | model | encode; other = round trip p50 - their sum"]
    lines += [format_row(r) for r in doc["rows"]]
    for f in doc["flow"]:
        lines.append(f"flow, {f['recipe']}, B=1 model ms: 1 step {f['model_ms_steps1_samples1']:.1f}, 4 steps "
                     f"{f['model_ms_steps4_samples1']:.1f} (3 extra steps "
                     f"{100 * f['extra_3_steps_share_of_4step']:.0f}%), "
                     f"4 steps x 8 samples {f['model_ms_steps4_samples8']:.1f} (the K-mean adds "
                     f"{100 * f['k8_mean_share_of_8sample']:.0f}%)")
    return "\n".join(lines)


def write(doc: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"serve-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{doc['device']}")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=2)
    with open(base + ".txt", "w") as f:
        f.write(format_table(doc) + "\n")
    return base
