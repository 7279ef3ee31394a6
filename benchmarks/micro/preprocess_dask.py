"""Preprocess throughput on Beam's Dask runner: 1 against N dask workers, with the local runner
(FnApiRunner, N worker processes) beside them; the same dataset, one run each, one invocation.

    loongforge bench preprocess-dask [--workers 2] [--episodes 16 --frames 150 --size 128 128]

Rows (frames = source frames x cameras, the job's own count):
  local-N   FnApiRunner with N worker processes (the default runner)
  dask-1    the Dask runner on a local dask.distributed cluster of 1 single-threaded worker process
  dask-N    the same with N worker processes
`job_s` runs from the pipeline's start to the published index: on Dask the cluster is already
up and its workers' imports done (as on a standing cluster); FnApiRunner starts its worker
processes inside it. `wall_s` is the whole job, the local dask cluster's start-up included.
The figure is the scaling efficiency on job_s: (dask-N frames/s / dask-1 frames/s) / N; with N
free cores and the per-episode work dominating, expect close to 1.0. Other work on the cores
lowers it: the load average before and after is recorded. Each row's index.json is checked
byte-identical to the local runner's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from loongforge.benchmarks.harness.report import RESULTS_DIR, machine_info, write_timestamped
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.runner.choice import RunnerConfig
from loongforge.preprocess.samples.dataset import generate_dataset

QUICK = {"episodes": 4, "frames": (30, 30), "height": 64, "width": 64, "gop": 30}


def _job(dataset: str, out: Path, runner: str, workers: int) -> dict:
    cfg = PreprocessConfig(input=dataset, output=str(out), workers=workers, progress_s=0)
    t0 = time.perf_counter()
    summary = run_job(cfg, [], RunnerConfig(name=runner))
    wall = time.perf_counter() - t0
    if summary["failed"]:
        raise RuntimeError(f"preprocess job had failures: {summary['failed_records']}")
    frames = summary["source_frames"] * len(summary["cameras"])
    return {"id": f"{runner}-{workers}", "runner": runner, "workers": workers, "frames": frames,
            "job_s": summary["seconds"], "wall_s": round(wall, 2),
            "frames_per_s": round(frames / summary["seconds"], 1),
            "conversions": summary.get("conversions"), "index_json": (out / "index.json").read_bytes()}


def run(spec: dict, workers: int, workdir: str | None = None) -> dict:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lf-bench-dask-", dir=workdir) as tmp:
        dataset = str(generate_dataset(Path(tmp) / "ds", **spec))
        rows = [_job(dataset, Path(tmp) / f"out-{runner}-{n}", runner, n)
                for runner, n in (("local", workers), ("dask", 1), ("dask", workers))]
    base = rows[0]["index_json"]
    for row in rows:
        row["index_identical"] = row.pop("index_json") == base
    one, many = rows[1]["frames_per_s"], rows[2]["frames_per_s"]
    return {"benchmark": "preprocess-dask", "machine": machine_info(), "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
            "dataset": {**spec, "frames": list(spec["frames"]), "cameras": 2}, "rows": rows,
            "scaling_efficiency": round(many / one / workers, 3) if one else None}


def format_table(doc: dict) -> str:
    head = f"| {'row':<8} | {'frames':>7} | {'job s':>7} | {'wall s':>7} | {'frames/s':>9} | {'same index':>10} |"
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in doc["rows"]:
        lines.append(f"| {r['id']:<8} | {r['frames']:>7} | {r['job_s']:>7.2f} | {r['wall_s']:>7.2f} | "
                     f"{r['frames_per_s']:>9.1f} | {'yes' if r['index_identical'] else 'NO':>10} |")
    lines.append(f"scaling efficiency dask-{doc['rows'][2]['workers']} over dask-1: {doc['scaling_efficiency']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="N: worker processes of local-N and dask-N (2)")
    p.add_argument("--episodes", type=int, default=16, help="episodes of the generated dataset (16)")
    p.add_argument("--frames", type=int, default=150, help="frames per episode and camera (150)")
    p.add_argument("--size", type=int, nargs=2, default=(128, 128), metavar=("H", "W"), help="frame size (128 128)")
    p.add_argument("--quick", action="store_true", help=f"a small input to check the benchmark runs: {QUICK}")
    p.add_argument("--workdir", default=None, help="where the dataset and outputs go (default: the system temp)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder (results/)")


def handle(args: argparse.Namespace) -> int:
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # the local clusters' own INFO lines
    spec = QUICK if args.quick else {"episodes": args.episodes, "frames": (args.frames, args.frames),
                                     "height": args.size[0], "width": args.size[1], "gop": 100}
    doc = run(spec, args.workers, args.workdir)
    print(f"dataset: {doc['dataset']}; cores: {os.cpu_count()}; load average start {doc['load_average_start']}, "
          f"end {doc['load_average_end']}")
    print(format_table(doc))
    write_timestamped(args.out, "preprocess-dask", doc)
    return 0
