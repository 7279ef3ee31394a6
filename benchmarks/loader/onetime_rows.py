"""The one-off costs: P4 (first epoch from an empty cache vs hot) and P5
(the preprocess transcode, and after how many epochs it has paid for itself).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from loongforge.benchmarks.loader import fast_path as lf
from loongforge.benchmarks.harness.daemon import CacheDaemon
from loongforge.benchmarks.harness.context import Context
from loongforge.benchmarks.harness.measure import PassTiming, Stat, batch_size_of, ratio, time_pass
from loongforge.benchmarks.harness.rows import Row

log = logging.getLogger(__name__)


def _epoch_pass(ctx: Context, workers: int, socket: str | None) -> PassTiming:
    """One whole epoch, first batch included: on a cold cache the first batch is
    where the first fills happen. Worker start-up is in it too, for cold and
    hot alike (its size shows in the first-batch figures)."""
    loader = ctx.make_loader(workers=workers, rgb=True, socket=socket)
    with lf.opened(loader) as ld:
        steps = ld.plan.steps
        batches = iter(ld)
        t0 = time.perf_counter()
        first = next(batches)
        first_s = time.perf_counter() - t0
        rest = time_pass(batches, warmup=0, timed=steps - 1)
    return PassTiming(samples=rest.samples + batch_size_of(first), seconds=first_s + rest.seconds, startup_s=first_s)


def p4_rows(ctx: Context, daemon_ok: str | None) -> list[Row]:
    workers = max(ctx.cfg.workers)
    title = "Cold start: first epoch, empty cache, local origin"
    root, hot_socket = ctx.prep.shards, ctx.socket
    if daemon_ok is not None or hot_socket is None:
        return [Row.unavailable("P4", title, daemon_ok or "no hot cache daemon", unit="samples/s")]
    shard_index = lf.shard_index_of(root)
    cold, hot, evicted = [], [], True
    for _ in range(ctx.cfg.repeats):
        with tempfile.TemporaryDirectory(prefix="lfb-") as tmp, \
                CacheDaemon(root, Path(tmp), ram_budget=ctx.cfg.ram_budget) as daemon:
            # Empty RAM and SSD tiers (fresh daemon) and the origin's files out of the page cache.
            evicted = lf.evict_page_cache(root, shard_index) and evicted
            cold.append(_epoch_pass(ctx, workers, daemon.socket))
        hot.append(_epoch_pass(ctx, workers, hot_socket))  # the long-warm daemon of P1-P3, same protocol
    c, h = Stat.of(t.samples_per_s for t in cold), Stat.of(t.samples_per_s for t in hot)
    row = Row(id="P4", title=title, unit="samples/s",
              params={**ctx.window_params(), "workers": workers, "repeats": ctx.cfg.repeats,
                      "origin": "local disk", "page_cache_evicted": evicted, "ram_budget": ctx.cfg.ram_budget,
                      "timed": "whole epoch incl. first batch (worker start-up in both)"},
              baseline_label="hot (P1's warm daemon, whole epoch)", ours_label="cold (fresh daemon, first epoch)",
              baseline=h, ours=c, ratio=ratio(c, h), ratio_note="cold / hot",
              extra={"first_batch_s_cold": Stat.of(t.startup_s for t in cold),
                     "first_batch_s_hot": Stat.of(t.startup_s for t in hot)})
    if not evicted:
        row.notes.append("could not evict the origin from the page cache: cold reads may be RAM-speed")
    return [row]


def p5_rows(ctx: Context) -> list[Row]:
    """P5/transcode: the preprocess job that made the shards; P5/break-even: epochs to pay it back."""
    return [_transcode_row(ctx), _break_even(ctx)]


def _transcode_row(ctx: Context) -> Row:
    prep, cfg = ctx.prep, ctx.cfg
    cores = max(1, min(prep.transcode_workers, _cores()))
    per_core = prep.source_frames / prep.transcode_s / cores
    row = Row(
        id="P5/transcode", title="Preprocess cost (one-off transcode)", unit="frames/s/core",
        params={"source_frames": prep.source_frames, "episodes": cfg.episodes, "cameras": list(cfg.cameras),
                "source_resolution": [cfg.height, cfg.width], "gop": cfg.gop, "workers": prep.transcode_workers,
                "cores_counted": cores, "runs": 1, "block_frames": cfg.block_frames},
        ours_label="loongforge preprocess (whole job, start-up included)",
        ours=Stat.of([per_core]), extra={"transcode_s": prep.transcode_s})
    row.notes.append("measured once per bench run (the job that made the shards), not repeated")
    return row


def _break_even(ctx: Context) -> Row:
    """From P1's NV12 cell at the most workers (what a GPU trainer takes)."""
    prep, w = ctx.prep, max(ctx.cfg.workers)
    key = ("p1-nv12", w)
    if key not in ctx.measured:
        return Row.unavailable("P5/break-even", "Epochs to pay back the transcode",
                               f"P1 at {w} workers was not measured")
    base, ours = ctx.measured[key]
    n, seconds = prep.num_samples, prep.transcode_s
    saved = [n / b - n / o for b in (base.median, base.min, base.max) for o in (ours.median,)]
    epochs = [seconds / s if s > 0 else float("inf") for s in saved]
    row = Row(id="P5/break-even", title="Epochs of training that pay back the transcode", unit="epochs",
              params={"workers": w, "samples_per_epoch": n, "transcode_s": seconds, "output": "NV12 uint8",
                      "formula": "transcode_s / (baseline_epoch_s - loongforge_epoch_s)"},
              ours_label="break-even", ours=Stat(epochs[0], min(epochs), max(epochs), ()),
              extra={"baseline_epoch_s": n / base.median, "loongforge_epoch_s": n / ours.median})
    row.notes.append("epoch times from P1's samples/s at the same worker count; spread from the baseline's spread")
    return row


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
