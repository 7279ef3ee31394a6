"""Order scale: what building one epoch's sample order costs ONE rank, lazy against full, same run.

    loongforge bench order-scale                                  # 10 M and 100 M samples, 8 ranks
    loongforge bench order-scale --samples 1e6 --walk 1e6         # quick

`full` is `order.block_sequence` + `rank_slice` (what BlockLoader did before: every rank
built the whole epoch, ~5 int64 arrays per sample); `lazy` is `order.EpochOrder` +
`rank_ids` (what it does now: per (episode, block) group, one window expanded). Each cell
is a fresh `python -c` process, as a rank starts: wall and CPU seconds to the rank's first
micro batch, and its peak RSS (ru_maxrss, the interpreter and numpy included; `base` is
the RSS before building). The lazy cells also walk the rank's whole epoch (every step's
`rank_ids`) at sizes <= `--walk`, which is the cost the lazy order spreads over the epoch.
Both cells hash the rank's first micro batch: `same` says the two orders agree there (the
tests check every position on small cases). Episodes as index_scale's (300-700 frames),
one sample per timestep, blocks of 16, run 4, window 65,536, the last of 8 ranks.
Prints a markdown table, writes results/order-scale-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from loongforge.benchmarks.harness.report import RESULTS_DIR

CHILD = r"""
import hashlib, json, resource, sys, time
import numpy as np
from loongforge.benchmarks.harness.dataset import EpochOrder, SampleTable, block_sequence, rank_slice
from loongforge.benchmarks.micro.index_scale import episode_lengths
mode, samples, block, run, window, batch, world, walk = sys.argv[1], *map(int, sys.argv[2:9])
rank = world - 1
table = SampleTable(episode_lengths(samples))
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss()
t0, c0 = time.perf_counter(), time.process_time()
if mode == "full":
    first = rank_slice(block_sequence(table.block_groups(block), 0, 0, run=run, window=window), 0, batch, rank, world)
else:
    lazy = EpochOrder(table, block, 0, 0, run=run, window=window)
    first = lazy.rank_ids(0, batch, rank, world)
out = {"build_s": time.perf_counter() - t0, "build_cpu_s": time.process_time() - c0, "peak_mb": rss(),
       "base_mb": base, "first_sha": hashlib.sha256(first.tobytes()).hexdigest()[:16]}
if mode == "lazy" and samples <= walk:
    t0, c0, steps = time.perf_counter(), time.process_time(), lazy.num_samples // batch  # the tail is dropped
    got = sum(len(lazy.rank_ids(c * batch, batch, rank, world)) for c in range(steps))
    out.update(walk_s=time.perf_counter() - t0, walk_cpu_s=time.process_time() - c0, walk_steps=steps,
               walk_samples=got, peak_after_walk_mb=rss())
print(json.dumps(out))
"""


def cell(mode: str, samples: int, args) -> dict:
    argv = [sys.executable, "-c", CHILD, mode, str(samples), str(args.block_frames), str(args.run),
            str(args.window), str(args.batch), str(args.world), str(int(args.walk))]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} at {samples} samples failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict]) -> str:
    lines = ["| samples | order | build to first batch s (CPU s) | peak RSS MB (base) | rank's whole-epoch walk s "
             "(CPU s), samples | same first batch |", "|---|---|---|---|---|---|"]
    for r in rows:
        walk = f"{r['walk_s']:.1f} ({r['walk_cpu_s']:.1f}), {r['walk_samples']:,}" if "walk_s" in r else "-"
        lines.append(f"| {r['samples']:,} | {r['mode']} | {r['build_s']:.2f} ({r['build_cpu_s']:.2f}) | "
                     f"{r['peak_mb']:,.0f} ({r['base_mb']:.0f}) | {walk} | {r.get('same', '-')} |")
    return "\n".join(lines)


def run(args) -> dict:
    rows = []
    for samples in (int(s) for s in args.samples):
        got = {mode: {"samples": samples, "mode": mode, **cell(mode, samples, args)} for mode in ("lazy", "full")}
        same = got["lazy"]["first_sha"] == got["full"]["first_sha"]
        for r in got.values():
            r["same"] = same
        rows += [got["lazy"], got["full"]]
    return {"benchmark": "order-scale", "rows": rows, "world": args.world, "rank": args.world - 1,
            "global_batch": args.batch, "block_frames": args.block_frames, "run": args.run, "window": args.window,
            "host": platform.node(), "python": sys.version.split()[0], "numpy": np.__version__}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=float, nargs="+", default=[10e6, 100e6])
    p.add_argument("--walk", type=float, default=10e6, help="walk the lazy rank's whole epoch up to this size")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batch", type=int, default=1024, help="global batch (a multiple of --world)")
    p.add_argument("--block-frames", type=int, default=16)
    p.add_argument("--run", type=int, default=4)
    p.add_argument("--window", type=int, default=65536)
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    load = os.getloadavg()
    doc = run(args)
    doc["load_avg"], doc["load_avg_end"] = load, os.getloadavg()
    print(markdown(doc["rows"]))
    print(f"\nrank {args.world - 1} of {args.world}, global batch {args.batch}; load average "
          f"{load[0]:.2f} -> {doc['load_avg_end'][0]:.2f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"order-scale-{time.strftime('%Y%m%d-%H%M%S')}-{platform.node()}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"results: {path}")
    return 0
