"""LeRobot's loading (what users run today) against LoongForge's LeRobot fast path, same items.

    python -m loongforge.benchmarks.loader.lerobot_baseline --workers 2 --json out.json
    python -m loongforge.benchmarks.loader.lerobot_baseline --episodes 2 --frames 40 60 --seconds 2   # a quick check
    loongforge bench lerobot-baseline --lerobot-venv /work/lerobot-venv   # against the real lerobot 0.6.1

`--lerobot-venv PATH` (a venv made by benchmarks/lerobot_venv/setup.sh) times the real lerobot 0.6.1
instead of the rebuilt one: `DataLoader(lerobot's LeRobotDataset(root, video_backend=B), ...)` in that
venv's Python (benchmarks/lerobot_venv/time_loader.py), B = pyav and torchcodec (reported as not
available where it does not run), both encodings written as v3.0 (lerobot 0.6.1 reads no other).

Data: `--dataset ROOT` (your own LeRobot roots, their cameras and fps), else GR00T-shaped sample data
(one 256x256 camera at 20 fps, 44-D state and action), in two encodings:
  gop2   re-encoded as LeRobot writes today: v3.0 layout, AV1 (`--codec`) with a keyframe every 2
         frames, `--episodes-per-file` episodes concatenated per mp4;
  gopL   the long-GOP H.264 (`--long-gop`, 250 as the GR00T demo data ships) of the generated v2.0 dataset.
Each is transcoded once by `loongforge preprocess` (not timed). Delta settings: "gr00t" (1 frame per
camera, state, 16 actions) and "lerobot2" (2 frames per camera and of state, 16 actions from t-1,
a common LeRobot policy setting, e.g. diffusion policy's n_obs_steps=2).

Rows: samples/s of a `torch.utils.data.DataLoader` over lerobot_style.LeRobotStyleDataset (LeRobot's
pyav backend rebuilt, its items checked bit-exact against lerobot's own) with N workers, against
`LeRobotLoader` (train/data/lerobot_loader.py: the same items, float RGB in [0, 1] on CPU) with N
decode workers; each pass pinned to the same max(1, N) cores (benchmarks/harness/cores.py), both
timed after one warm-up batch over at least `--seconds` of full batches, the ratio measured in the
same run. torchcodec (LeRobot's default backend) is reported when it loads; on a CPU-only torch
it does not (benchmarks/README.md). Goals: >= 20x at GOP 2, >= 100x at long GOP.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from loongforge.benchmarks.harness.cores import cores_for, pinned
from loongforge.benchmarks.harness.report import RESULTS_DIR, machine_info, write_timestamped
from loongforge.benchmarks.loader.baseline import torchcodec_status
from loongforge.benchmarks.loader.lerobot_style import LeRobotStyleDataset
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.samples.dataset import generate_preset
from loongforge.preprocess.samples.layouts import write_v3
from loongforge.preprocess.stages.discover import discover
from loongforge.shared.errors import UsageError
from loongforge.train.data.lerobot_loader import LeRobotLoader

log = logging.getLogger(__name__)
GOALS = {"gop2": 20.0, "gopL": 100.0}


def delta_settings(fps: float, cameras: list[str], horizon: int = 16) -> dict[str, dict]:
    return {
        "gr00t": {**{c: [0.0] for c in cameras}, "observation.state": [0.0],
                  "action": [i / fps for i in range(horizon)]},
        "lerobot2": {**{c: [-1 / fps, 0.0] for c in cameras}, "observation.state": [-1 / fps, 0.0],
                     "action": [(i - 1) / fps for i in range(horizon)]},
    }


def build_data(work: Path, args) -> dict[str, tuple[str, str]]:
    """encoding -> (LeRobot root, shard root): each --dataset root (read in place, its shards under
    `work`), else the generated data in both encodings."""
    if args.dataset:
        out = {}
        for i, src in enumerate(args.dataset):
            shards = work / f"dataset{i}-shards"
            run_job(PreprocessConfig(input=src, output=str(shards), workers=args.workers or 1, progress_s=0),
                    ["--direct_running_mode=in_memory", "--direct_num_workers=1"] if args.workers == 0 else [])
            out[src] = (src, str(shards))
        return out
    size = {"height": args.size, "width": args.size}
    v2 = generate_preset(work / "gopL", "gr00t-like", episodes=args.episodes, frames=tuple(args.frames),
                         gop=args.long_gop, **size)
    v3 = write_v3(v2, work / "gop2", codec=args.codec, gop=2, episodes_per_file=args.episodes_per_file)
    if args.lerobot_venv:  # lerobot 0.6.1 reads v3.0 only: the long GOP re-encoded as it ships, in that layout
        v2 = write_v3(v2, work / "gopL-v3", codec="h264", gop=args.long_gop, episodes_per_file=args.episodes_per_file)
    out = {}
    for name, src in (("gop2", v3), ("gopL", v2)):
        shards = work / f"{name}-shards"
        run_job(PreprocessConfig(input=str(src), output=str(shards), workers=args.workers or 1, progress_s=0),
                ["--direct_running_mode=in_memory", "--direct_num_workers=1"] if args.workers == 0 else [])
        out[name] = (str(src), str(shards))
    return out


def _time(batches, seconds: float, batch_size: int) -> dict:
    """Samples/s over full batches after the first (warm-up), for at least `seconds`."""
    next(batches)
    n, t0 = 0, time.perf_counter()
    while True:
        next(batches)
        n += 1
        took = time.perf_counter() - t0
        if took >= seconds:
            return {"samples_per_s": n * batch_size / took, "batches": n, "seconds": round(took, 3)}


def _endless(loader):
    while True:
        yield from loader


def time_baseline(src: str, deltas: dict, args) -> dict:
    ds = LeRobotStyleDataset(src, delta_timestamps=deltas)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                         generator=torch.Generator().manual_seed(0), drop_last=True,
                                         persistent_workers=args.workers > 0)
    return _time(_endless(loader), args.seconds, args.batch_size)


def time_real_lerobot(src: str, deltas: dict, args, backend: str) -> dict:
    """The real lerobot in its own venv (time_loader.py); {"error": ...} where the backend does not run."""
    script = Path(__file__).resolve().parents[1] / "lerobot_venv" / "time_loader.py"
    cmd = [str(Path(args.lerobot_venv) / "bin" / "python"), str(script), "--root", src, "--deltas", json.dumps(deltas),
           "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--seconds", str(args.seconds),
           "--backend", backend]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = run.stdout.strip().splitlines()
    if run.returncode or not lines:
        return {"error": f"exit {run.returncode}: {run.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def time_fast(shards: str, deltas: dict, args) -> dict:
    with LeRobotLoader(shards, delta_timestamps=deltas, batch_size=args.batch_size, num_workers=args.workers,
                       split="all") as loader:
        batches = iter(loader)
        next(batches)
        loader.wait_ready()  # every worker past start-up before the clock starts
        return _time(batches, args.seconds, args.batch_size)


def run(args) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same intra-op setting in both passes; the pinned cores are the budget
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test) keeps its own setting


def _run(args) -> list[dict]:
    if args.work:
        os.makedirs(args.work, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lf-lerobot-bench-", dir=args.work) as tmp:
        data = build_data(Path(tmp), args)
        rows = []
        for encoding, (src, shards) in data.items():
            meta, _ = discover(src)
            cameras = [c.key for c in meta.cameras if c.kind == "video"]
            for setting, deltas in delta_settings(meta.fps, cameras).items():
                if args.settings and setting not in args.settings:
                    continue
                with pinned(cores_for(args.workers)) as cores:
                    if args.lerobot_venv:
                        base = time_real_lerobot(src, deltas, args, "pyav")
                        codec_row = time_real_lerobot(src, deltas, args, "torchcodec")
                    else:
                        base, codec_row = time_baseline(src, deltas, args), None
                    fast = time_fast(shards, deltas, args)
                if "error" in base:
                    raise UsageError(f"lerobot in {args.lerobot_venv} did not run: {base['error']}")
                ratio = fast["samples_per_s"] / base["samples_per_s"]
                goal = GOALS.get(encoding)  # none for a --dataset: the goals are set for the generated encodings
                label = encoding if args.dataset else \
                    f"{args.codec if encoding == 'gop2' else 'h264'} GOP {2 if encoding == 'gop2' else args.long_gop}"
                rows.append({"encoding": encoding, "gop": 2 if encoding == "gop2" else args.long_gop,
                             "codec": args.codec if encoding == "gop2" else "h264", "label": label,
                             "setting": setting,
                             "workers": args.workers, "cores": cores, "baseline": base, "loongforge": fast,
                             "ratio": ratio, "goal": goal, "met": goal is None or ratio >= goal,
                             "baseline_kind": "lerobot 0.6.1" if args.lerobot_venv else "rebuilt pyav loading",
                             "torchcodec": codec_row})
                log.info("%s %s: %.1f vs %.1f samples/s (%.1fx)", encoding, setting, base["samples_per_s"],
                         fast["samples_per_s"], ratio)
    return rows


def table(rows: list[dict], torchcodec: str | None) -> str:
    real = bool(rows) and rows[0].get("torchcodec") is not None
    lines = ["| Encoding | Deltas | Workers | LeRobot pyav (samples/s) | LoongForge (samples/s) | Ratio | Goal |"
             + (" lerobot torchcodec (samples/s) |" if real else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if real else "")]
    for r in rows:
        tc = r.get("torchcodec") or {}
        tc_cell = f" {tc['samples_per_s']:,.1f} |" if "samples_per_s" in tc else " not available |"
        goal = "n/a (your data)" if r["goal"] is None else f">= {r['goal']:g}x: {'met' if r['met'] else 'MISSED'}"
        lines.append(f"| {r['label']} | {r['setting']} | {r['workers']} | "
                     f"{r['baseline']['samples_per_s']:,.1f} | {r['loongforge']['samples_per_s']:,.1f} | "
                     f"{r['ratio']:,.1f}x | {goal} |"
                     + (tc_cell if real else ""))
    if real:
        errors = {r["torchcodec"]["error"] for r in rows if "error" in r["torchcodec"]}
        lines.append("baseline: the real lerobot 0.6.1" + (f"; its torchcodec backend: {sorted(errors)[0]}"
                                                          if errors else ""))
    else:
        lines.append(f"torchcodec: {'available' if torchcodec is None else 'not available: ' + torchcodec}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", action="append", default=[], metavar="ROOT",
                   help="a LeRobot dataset root of your own, timed instead of the generated data (its cameras and "
                        "fps; v3.0 with --lerobot-venv, which reads no other); repeat for several")
    p.add_argument("--workers", type=int, default=2, help="DataLoader / decode workers of both loaders (2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--episodes", type=int, default=8, help="GR00T-shaped episodes (8)")
    p.add_argument("--frames", type=int, nargs=2, default=(260, 470), metavar=("A", "B"),
                   help="frames per episode, drawn from [A, B] (260 470, the GR00T demo data's range)")
    p.add_argument("--size", type=int, default=256, help="frame height and width (256)")
    p.add_argument("--long-gop", type=int, default=250, help="keyframe interval of the long-GOP encoding (250)")
    p.add_argument("--codec", choices=("av1", "h264"), default="av1", help="GOP-2 encoding's codec (av1, LeRobot's)")
    p.add_argument("--episodes-per-file", type=int, default=4, help="v3.0 episodes per mp4 (4)")
    p.add_argument("--settings", nargs="*", choices=("gr00t", "lerobot2"), default=None, help="delta settings (both)")
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per pass, at least (20)")
    p.add_argument("--lerobot-venv", default=None, metavar="PATH",
                   help="time the real lerobot 0.6.1 in this venv (benchmarks/lerobot_venv/setup.sh) instead of the "
                   "rebuilt pyav loading; both encodings written as v3.0")
    p.add_argument("--work", default=None, help="directory for the generated data (a temp dir, removed after)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder (lerobot-baseline-<time>-<host>.json)")


def handle(args: argparse.Namespace) -> int:
    if args.workers < 0 or args.batch_size < 1 or args.seconds <= 0 or args.episodes < 1:
        raise UsageError("--workers >= 0, --batch-size >= 1, --seconds > 0, --episodes >= 1")
    if args.lerobot_venv and not (Path(args.lerobot_venv) / "bin" / "python").exists():
        raise UsageError(f"--lerobot-venv {args.lerobot_venv}: no bin/python; make it with "
                         "bash benchmarks/lerobot_venv/setup.sh PATH")
    for root in args.dataset:
        discover(root)  # not a dataset LoongForge reads: one line before any work
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    machine = machine_info()
    rows = run(args)
    torchcodec = torchcodec_status()
    print(table(rows, torchcodec))
    machine["load_average_end"] = list(os.getloadavg())
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command", "bench", "raw_argv")}
    write_timestamped(args.out, "lerobot-baseline", {"args": settings, "machine": machine, "rows": rows,
                                                     "torchcodec": torchcodec})
    return 0
