"""P1's format question on its own: format 1 against format 2, same frames, long enough to tell.

    python -m loongforge.benchmarks.loader.p1_formats --workdir /tmp/p1f           # quick shape, 8 episodes
    python -m loongforge.benchmarks.loader.p1_formats --workdir W --reuse          # a `bench --workdir W` run's roots

`loongforge bench --quick` times 10 batches of 4 per LoongForge pass: at 1,000-4,000 samples/s
that is a 10-40 ms window, a few of the 10 ms CPU-clock ticks the busy-core figure counts in,
so one scheduler slice on a loaded box decides the cell and P1's v1 and v2 cells can swing
3-9x either way within one run. The quick grid stays a smoke test (make test runs it); this
benchmark answers "is format 2 slower than format 1 at P1's shape" properly.

Both loaders as P1 builds them (`loongforge_path.make_loader` / `make_loader_v2`: ShardLoader
over K-frame windows; BlockLoader at video deltas -(K-1)..0, same stride, default block order
and cache), NV12 out, pinned to max(1, W) cores, read from the origin through the page cache
(or each root's own hot cache daemon with `--daemon`, as P1). Per round and worker count the
two formats run back to back, the first of them alternating by round; each pass warms up, waits
for every worker (`ShardLoader.wait_ready`), pulls the batches decoded meanwhile, then times
`--batches` batches inside the first epoch (a second epoch would find format 2's blocks cached).
Reported per W: each format's median samples/s, the median of the per-round v2/v1 ratios
[min-max], CPU us per sample of the process tree; and, counted in-process over one epoch with a
cold block cache (load-independent), format 2's block decodes per sample and frames decompressed
per sample against format 1's K per camera. Writes results/p1-formats-<time>-<host>.json.
"""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness import data
from loongforge.benchmarks.loader import fast_path as lf
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.cores import CpuMeter, cores_for, pinned
from loongforge.benchmarks.harness.measure import Stat, ratio, time_pass
from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import load_index


def make_roots(cfg: BenchConfig, workdir: Path) -> None:
    """The bench's two roots of one generated dataset (data.prepare, without the GOP copies)."""
    workdir.mkdir(parents=True, exist_ok=True)
    data.generate(cfg, workdir / "lerobot")
    data.transcode(cfg, workdir / "lerobot", workdir / "shards_v2", 2)
    data.transcode(cfg, workdir / "lerobot", workdir / "shards", 1)


def _loader(cfg, workdir: Path, version: int, workers: int, socket: str | None):
    if version == 2:
        return lf.make_loader_v2(str(workdir / "shards_v2"), cfg, workers=workers, socket=socket, rgb=False)
    root = str(workdir / "shards")
    return lf.make_loader(root, load_index(root), cfg, workers=workers, socket=socket, rgb=False)


def one_pass(cfg, workdir: Path, version: int, workers: int, batches: int, socket: str | None):
    with pinned(cores_for(workers)):
        loader = _loader(cfg, workdir, version, workers, socket)
        with lf.opened(loader):
            epoch = loader.plan.steps
            t = time_pass(iter(loader), warmup=1, timed=batches, meter=CpuMeter(), ready=loader.wait_ready)
    if 1 + t.settle_batches + batches > epoch:
        raise ConfigError(f"p1_formats: {1 + t.settle_batches + batches} batches pass the epoch of {epoch}: "
                          "lower --batches or raise --episodes")
    return t


def block_decodes(cfg, workdir: Path) -> dict:
    """Format 2's worker body over one epoch in its own order, cold cache: decodes counted."""
    from loongforge.train.data import workers

    loader = _loader(cfg, workdir, 2, 0, None)
    filler = workers._open_filler(loader.source_spec, None, loader.layout, loader.filler_spec)
    buf, plans, samples = np.empty(loader.layout.nbytes, np.uint8), loader._plans(), 0
    try:
        for _ in range(loader.plan.steps):
            _, k, items = next(plans)
            filler.fill(loader.layout.views(buf, k), items, "raise")
            samples += len(items)
        misses = filler.cache.misses
    finally:
        filler.close()
    cams, block = len(cfg.cameras), int(loader.block_size)
    return {"samples": samples, "block_size": block, "block_decodes_per_sample": misses / samples,
            "frames_decompressed_per_sample_v2": misses * block / samples,
            "frames_decompressed_per_sample_v1": cfg.frames_per_sample * cams}


def run(cfg: BenchConfig, workdir: Path, *, rounds: int, batches: int, workers: tuple[int, ...],
        daemon: bool) -> dict:
    from loongforge.benchmarks.harness.daemon import CacheDaemon

    passes = {(v, w): [] for v in (1, 2) for w in workers}
    with ExitStack() as stack:
        sockets = {1: None, 2: None}
        if daemon:
            for v, name in ((1, "shards"), (2, "shards_v2")):
                d = stack.enter_context(CacheDaemon(str(workdir / name), workdir / f"p1f-hot{v}"))
                lf.warm_cache(str(workdir / name), lf.shard_index_of(str(workdir / name), v), d.socket)
                sockets[v] = d.socket
        for r in range(rounds):
            for w in workers:
                for v in ((1, 2) if r % 2 == 0 else (2, 1)):
                    passes[(v, w)].append(one_pass(cfg, workdir, v, w, batches, sockets[v]))
    rows = []
    for w in workers:
        v1, v2 = passes[(1, w)], passes[(2, w)]
        per_round = [b.samples_per_s / a.samples_per_s for a, b in zip(v1, v2) if a.samples_per_s > 0]
        cpu_us = {v: Stat.of([1e6 * p.cpu_s / p.samples for p in passes[(v, w)]]).to_dict() for v in (1, 2)}
        rows.append({"workers": w, "v1_samples_per_s": Stat.of([p.samples_per_s for p in v1]).to_dict(),
                     "v2_samples_per_s": Stat.of([p.samples_per_s for p in v2]).to_dict(),
                     "v2_over_v1": Stat.of(per_round).to_dict(), "cpu_us_per_sample": cpu_us,
                     "v2_over_v1_of_medians": ratio(Stat.of([p.samples_per_s for p in v2]),
                                                    Stat.of([p.samples_per_s for p in v1])).median})
    return {"config": cfg.to_dict(), "rounds": rounds, "timed_batches": batches, "daemon": daemon,
            "load_average_end": list(os.getloadavg()), "rows": rows, "decodes": block_decodes(cfg, workdir)}


def table(doc: dict) -> str:
    out = ["| workers | v1 samples/s | v2 samples/s | v2/v1 per round, median [min-max] | CPU us/sample v1 / v2 |",
           "|---|---|---|---|---|"]
    for r in doc["rows"]:
        q, c = r["v2_over_v1"], r["cpu_us_per_sample"]
        out.append(f"| {r['workers']} | {r['v1_samples_per_s']['median']:,.0f} | {r['v2_samples_per_s']['median']:,.0f}"
                   f" | {q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}] | {c[1]['median']:.0f} / "
                   f"{c[2]['median']:.0f} |")
    d = doc["decodes"]
    out.append(f"\nformat 2, one epoch, cold cache: {d['block_decodes_per_sample']:.3f} block decodes/sample "
               f"(B={d['block_size']}) = {d['frames_decompressed_per_sample_v2']:.1f} frames decompressed/sample; "
               f"format 1: {d['frames_decompressed_per_sample_v1']}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loongforge.benchmarks.loader.p1_formats", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--reuse", action="store_true", help="read WORKDIR/shards and WORKDIR/shards_v2 as they are")
    p.add_argument("--episodes", type=int, default=8, help="episodes of the generated dataset (quick shape)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", type=int, default=50, help="timed batches per pass (of the quick batch, 4)")
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--daemon", action="store_true", help="read through each root's hot cache daemon, as P1")
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    cfg = BenchConfig.quick_preset(episodes=args.episodes)
    if not args.reuse:
        make_roots(cfg, args.workdir)
    doc = run(cfg, args.workdir, rounds=args.rounds, batches=args.batches, daemon=args.daemon,
              workers=tuple(int(w) for w in args.workers.split(",")))
    print(table(doc))
    write_timestamped(args.out, "p1-formats", doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
