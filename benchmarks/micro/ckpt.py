"""Checkpoint stall: how long the step loop is held up by a save, asynchronous
(snapshot to host memory, background writer) against synchronous (written in
the step loop), with a run that never saves as the baseline. Same machine, same
data, same recipe, one invocation; each mode runs in turn, `--repeats` times.

    loongforge bench ckpt --recipe small --steps 24 --save-every 4 --delta-steps 10,100

Per mode, from metrics.jsonl: `save_s` (the blocking part of each save, recorded
on the step after it) and `step_s`. The stall per save is
(loop time of the mode - loop time without saves) / saves, where loop time =
sum(step_s) + sum(save_s): it includes the steps slowed by a writer running
beside them, not only the blocking snapshot.

`--delta-steps 10,100`: one more run (synchronous saves, so save_s is the whole
save) with a full save at step 10 and deltas against it every 10 steps; reports
the delta/full byte ratio (from the writer's log) and the save-time ratio at 10
and 100 steps from the base.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from loongforge.benchmarks.harness.dataset import synthetic_train_root
from loongforge.benchmarks.harness.report import RESULTS_DIR

MODES = {"none": [], "sync": ["--sync-save"], "async": []}


def _run(mode: str, args, data: tuple[str, list[str]], work: str, idx: int) -> dict:
    run_dir = os.path.join(work, f"{mode}{idx}")
    save = [] if mode == "none" else ["--save-every", str(args.save_every), *MODES[mode]]
    # The final save (synchronous in every mode) follows the last row: it is not in the loop time.
    root, flags = data
    cmd = [sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--recipe", args.recipe,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--zero", "2", "--no-ds-breakdown",
           "--log-every", "1000", *flags, *save]
    if args.ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(args.ranks),
               "--master_port", str(_port()), "-m", *cmd[2:]]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[args.warmup:]  # the first steps pay allocator and thread-pool warm-up
    saves = [r["save_s"] for r in rows if "save_s" in r]
    loop = sum(r["step_s"] for r in rows) + sum(saves)
    size = _ckpt_bytes(run_dir)
    return {"mode": mode, "loop_s": loop, "saves": len(saves), "blocking_s": saves, "ckpt_bytes": size,
            "step_s_median": statistics.median(r["step_s"] for r in rows)}


def delta_run(args, data: tuple[str, list[str]], work: str) -> dict:
    dists = sorted(int(x) for x in args.delta_steps.split(","))
    every = min(dists)
    run_dir = os.path.join(work, "delta")
    root, flags = data
    cmd = [sys.executable, "-m", "loongforge.train", "--data", root, *flags, "--run-dir", run_dir, "--recipe", args.recipe,
           "--steps", str(every + max(dists) + 1), "--batch-size", str(args.batch_size), "--zero", "2",
           "--no-ds-breakdown", "--log-every", "1000", "--sync-save", "--save-every", str(every),
           "--full-every", "100000", "--delta-max-ratio", "1.0", "--keep-last", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"delta run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    ratio = {}
    for line in proc.stderr.splitlines():  # "checkpoint stepA: delta against stepB, X% of a full save"
        if ": delta against step" in line:
            a = int(line.split("checkpoint step")[1][:8])
            b = int(line.split("delta against step")[1][:8])
            ratio[a - b] = float(line.rsplit(", ", 1)[1].split("%")[0]) / 100
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    save_s = {r["step"]: r["save_s"] for r in rows if "save_s" in r}  # on the step after the save
    full_s = save_s.get(every)
    out = {}
    for d in dists:
        if d in ratio:
            out[d] = {"bytes_ratio": ratio[d], "save_time_ratio": save_s.get(every + d, float("nan")) / full_s
                      if full_s and (every + d) in save_s else None}
    return out


def _ckpt_bytes(run_dir: str) -> int:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.exists(os.path.join(root, "latest")):
        return 0
    tag = open(os.path.join(root, "latest")).read().strip()
    return sum(e.stat().st_size for e in os.scandir(os.path.join(root, tag)) if e.is_file())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(results: list[dict]) -> dict:
    by = {m: [r for r in results if r["mode"] == m] for m in MODES}
    base = statistics.median(r["loop_s"] for r in by["none"])
    out = {"loop_s_no_save": base}
    for m in ("sync", "async"):
        rs = by[m]
        n = rs[0]["saves"]
        out[m] = {"stall_per_save_s": statistics.median((r["loop_s"] - base) / n for r in rs),
                  "blocking_per_save_s": statistics.median(b for r in rs for b in r["blocking_s"]),
                  "saves": n, "ckpt_bytes": rs[0]["ckpt_bytes"]}
    # Under a loaded machine the loop-time difference can be below the noise (even negative): no ratio then.
    sync_stall = out["sync"]["stall_per_save_s"]
    out["async_over_sync_stall"] = out["async"]["stall_per_save_s"] / sync_stall if sync_stall > 0 else None
    out["async_over_sync_blocking"] = (out["async"]["blocking_per_save_s"]
                                       / max(out["sync"]["blocking_per_save_s"], 1e-9))
    return out


def _x(v) -> str:
    return "n/a (below the load noise)" if v is None else f"{v:.2f}x"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="small")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the loop time")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--delta-steps", default="", help="e.g. 10,100: delta/full ratios at these distances from the "
                   "base (one extra run)")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="lf-ckpt-bench-") as work:
        root = os.path.join(work, "root")
        data = root, synthetic_train_root(root, (16,) * 4)  # 64 samples of 2 frames per camera
        results = [_run(m, args, data, work, i) for i in range(args.repeats) for m in MODES]
        summary = summarize(results)
        if args.delta_steps:
            summary["delta"] = delta_run(args, data, work)
    options = {k: v for k, v in vars(args).items() if not callable(v)}  # the parsed options, not the handler
    doc = {"benchmark": "checkpoint-stall", "args": options, "summary": summary, "runs": results,
           "load_avg": os.getloadavg(), "cpus": os.cpu_count()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ckpt-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    s, a = summary["sync"], summary["async"]
    print(f"| mode | step-loop stall per save (s) | blocking per save (s) | checkpoint MB |\n|---|---|---|---|\n"
          f"| sync  | {s['stall_per_save_s']:.3f} | {s['blocking_per_save_s']:.3f} | {s['ckpt_bytes'] / 1e6:.1f} |\n"
          f"| async | {a['stall_per_save_s']:.3f} | {a['blocking_per_save_s']:.3f} | {a['ckpt_bytes'] / 1e6:.1f} |\n"
          f"async/sync: stall {_x(summary['async_over_sync_stall'])}, "
          f"blocking {summary['async_over_sync_blocking']:.2f}x  ({path})")
    for d, v in summary.get("delta", {}).items():
        st = v["save_time_ratio"]
        print(f"delta {d} steps after the full save: {100 * v['bytes_ratio']:.1f}% of its bytes, save time "
              f"{'n/a' if st is None else f'{100 * st:.0f}%'} of the full save's")
    return 0
