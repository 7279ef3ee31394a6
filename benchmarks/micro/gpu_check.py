"""`make gpu-check`: everything only a GPU can check, in one short run (< 4 min on one H200).

    loongforge bench gpu-check [--out results/gpu] [--steps 20]

1. every CUDA-only test: `pytest -m gpu tests` (the marker, not a list, so new GPU tests join);
2. a 20-step `tiny` and a 20-step `small` run on one GPU with --profile-steps, each followed by
   `loongforge profile --json` (trace-based breakdown: exposed comm, launch overhead, ...); and
   `tiny` with --zero 3 --grad-compression topk (hybrid sharding: the compressor's DP sync over a
   1-rank NCCL group, each step, counted as group "dp" in the metrics);
3. the `tiny` run again with --cuda-graphs (train/kernels/graphs.py): GPU idle inside the step (no kernel
   on any stream, data wait excluded: the trace's launch overhead) before/after, in `launch_overhead`;
4. writes OUT/gpu-check-<date>.json (tests, every breakdown, the GPU, torch, CUDA) and
   OUT/gpu-check-<date>.txt (the profile tables). Exit 0 only if every part passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from loongforge.benchmarks.harness.dataset import synthetic_train_root
from loongforge.benchmarks.harness.report import RESULTS_DIR, SOURCE_CHECKOUT

REPO = str(SOURCE_CHECKOUT)
RECIPES = ("tiny", "small")
TOPK = ("--zero", "3", "--grad-compression", "topk")  # train/parallel/compression.py on NCCL


def _run(cmd: list[str], timeout: float, **kw) -> tuple[int, str, float]:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DS_ACCELERATOR", None)  # a CPU override would hide the GPU
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kw)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        return 124, out + f"\n[gpu-check] timed out after {timeout:.0f} s", time.monotonic() - t0


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if env["cuda_available"]:
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return env


def gpu_tests(out_dir: str, timeout: float) -> dict:
    junit = os.path.join(out_dir, "gpu-tests.xml")
    code, log, took = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}", "tests"], timeout)
    res = {"exit_code": code, "seconds": round(took, 1), "log_tail": log[-4000:]}
    if os.path.exists(junit):
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        res.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        res["cases"] = [{"name": f"{c.get('classname')}::{c.get('name')}",
                         "result": next((ch.tag for ch in c if ch.tag in ("failure", "error", "skipped")), "passed")}
                        for c in suite.iter("testcase")]
        os.unlink(junit)
    res["ok"] = code == 0 and res.get("tests", 0) > 0
    return res


def train_run(recipe: str, data: str, work: str, steps: int, timeout: float, device: str = "cuda",
              extra: tuple[str, ...] = (), data_flags: tuple[str, ...] = ()) -> dict:
    label = recipe + "".join("+" + x[2:] if x.startswith("--") else "=" + x for x in extra)
    run_dir = os.path.join(work, label)
    a, b = max(1, steps // 4), max(2, steps // 4 + 3)  # past warm-up (and graph recording), 3 traced steps
    code, log, took = _run([sys.executable, "-m", "loongforge.train", "--data", data, "--run-dir", run_dir,
                            "--recipe", recipe, "--steps", str(steps), "--batch-size", "16", "--workers", "2",
                            "--device", device, "--profile-steps", f"{a}:{b}", "--no-ds-breakdown", *data_flags,
                            *extra], timeout)
    res = {"recipe": label, "exit_code": code, "seconds": round(took, 1), "profile_steps": [a, b]}
    if code != 0:
        return {**res, "ok": False, "log_tail": log[-4000:]}
    pcode, pout, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--json", "--no-chart"], 120)
    tcode, table, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--no-chart"], 120)
    with open(os.path.join(run_dir, "ds_config.json")) as f:
        optimizer = json.load(f)["optimizer"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, filter(str.strip, f)) if "step" in m]
    timers = sorted({m.get("timer") for m in steps} - {None})
    problems = []
    if "topk" in extra and not all("dp" in (m.get("comm_groups") or {}) for m in steps):
        problems.append("--grad-compression topk: a step without the compressor's DP sync (no 'dp' comm group)")
    if pcode or tcode:
        problems.append(f"loongforge profile failed: {(pout + table)[-2000:]}")
    from loongforge.train.parallel.engine import fused_adam_prebuilt

    if not optimizer["params"].get("torch_adam") and not fused_adam_prebuilt():
        problems.append(f"optimizer {optimizer} would need a DeepSpeed op build")
    if "cuda_events" not in timers:
        problems.append(f"metrics timers {timers}: no CUDA-event timing")
    breakdown = json.loads(pout) if pcode == 0 else None
    if breakdown is not None and not any(t["kind"] == "gpu" for t in breakdown["traces"]):
        problems.append("the profile has no GPU trace (no kernels recorded)")
    return {**res, "ok": not problems, "problems": problems, "optimizer": optimizer, "timers": timers,
            "breakdown": breakdown, "table": table if tcode == 0 else None}


def idle_per_step(run: dict) -> dict | None:
    """Mean seconds per traced step of a run's GPU trace: step, GPU idle (no kernel on any stream),
    and its launch-overhead part (idle while the host is not waiting on data)."""
    traces = [t for t in ((run.get("breakdown") or {}).get("traces") or []) if t["kind"] == "gpu"]
    if not traces:
        return None
    t = traces[0]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"step_s": mean(t["step_s"]), "gpu_idle_s": mean(t["gpu_idle_s"]),
            "launch_overhead_s": mean(t["launch_overhead_s"])}


def launch_overhead(eager: dict, graphed: dict) -> dict:
    """Before/after --cuda-graphs on the same recipe and data: the seed's "kernel launch and
    scheduling" slice, measured as GPU idle inside the step that is not data wait."""
    before, after = idle_per_step(eager), idle_per_step(graphed)
    res = {"eager": before, "cuda_graphs": after, "ok": before is not None and after is not None}
    if res["ok"]:
        for k in ("launch_overhead_s", "step_s"):
            res[f"{k}_ratio"] = after[k] / before[k] if before[k] else None
        res["launch_overhead_share"] = {"eager": before["launch_overhead_s"] / before["step_s"],
                                        "cuda_graphs": after["launch_overhead_s"] / after["step_s"]}
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.path.join(str(RESULTS_DIR), "gpu"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-tests", action="store_true", help="only the two training runs")


def handle(a: argparse.Namespace) -> int:
    env = environment()
    if not env["cuda_available"]:
        print(f"gpu-check: torch {env['torch']} sees no CUDA device (torch.version.cuda={env['cuda']}). On a GPU "
              "box: `make gpu-check` installs the CUDA build (see README, GPU check).", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
    report = {"started": stamp, "environment": env, "runs": []}
    t0 = time.monotonic()
    report["tests"] = {"ok": True, "skipped_by_flag": True} if a.skip_tests else gpu_tests(a.out, 180)
    with tempfile.TemporaryDirectory(prefix="loongforge-gpu-check-") as work:
        data = os.path.join(work, "shards")
        flags = tuple(synthetic_train_root(data, (64,) * 4, height=96, width=96, shard_size=1 << 22))
        for recipe in RECIPES:
            report["runs"].append(train_run(recipe, data, work, a.steps, 150, data_flags=flags))
        graphed = train_run("tiny", data, work, a.steps, 150, extra=("--cuda-graphs",), data_flags=flags)
        report["runs"].append(graphed)
        report["runs"].append(train_run("tiny", data, work, min(a.steps, 10), 150, extra=TOPK, data_flags=flags))
        report["launch_overhead"] = launch_overhead(report["runs"][0], graphed)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["ok"] = report["tests"]["ok"] and all(r["ok"] for r in report["runs"]) and report["launch_overhead"]["ok"]
    base = os.path.join(a.out, f"gpu-check-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    with open(base + ".txt", "w") as f:
        f.write("\n\n".join(f"== {r['recipe']} ==\n{r.get('table') or r.get('log_tail', '')}" for r in report["runs"]))
    for r in report["runs"]:
        print(f"== {r['recipe']}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s {r.get('problems') or ''}")
        print(r.get("table") or r.get("log_tail", ""))
    lo = report["launch_overhead"]
    if lo["ok"]:
        print("launch overhead (GPU idle in the step, not data wait), tiny, ms/step: eager "
              f"{lo['eager']['launch_overhead_s'] * 1e3:.2f} of {lo['eager']['step_s'] * 1e3:.2f}, --cuda-graphs "
              f"{lo['cuda_graphs']['launch_overhead_s'] * 1e3:.2f} of {lo['cuda_graphs']['step_s'] * 1e3:.2f}")
    t = report["tests"]
    counts = {k: t.get(k) for k in ("tests", "failures", "errors", "skipped")}
    print(f"gpu tests: {'ok' if t['ok'] else 'FAILED'} {json.dumps(counts)}")
    if not t["ok"]:
        print(t.get("log_tail", ""))
    print(f"gpu-check {'passed' if report['ok'] else 'FAILED'} in {report['seconds']} s: {base}.json, {base}.txt")
    return 0 if report["ok"] else 1
