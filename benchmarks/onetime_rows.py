"""The one-off costs: P4 (first epoch from an empty cache vs hot) and P5
(the preprocess transcode, and after how many epochs it has paid for itself).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from loongforge.benchmarks import loongforge_path as lf
from loongforge.benchmarks.daemon import CacheDaemon
from loongforge.benchmarks.context import Context
from loongforge.benchmarks.measure import PassTiming, Stat, batch_size_of, ratio, time_pass
from loongforge.benchmarks.rows import Row

log = logging.getLogger(__name__)


def _epoch_pass(ctx: Context, workers: int, socket: str | None) -> PassTiming:
    """One whole epoch, first batch included: on a cold cache the first batch is
    where the first fills happen. Worker start-up is in it too, for cold and
    hot alike (its size shows in the first-batch figures)."""
    steps = ctx.prep.index.num_samples // ctx.cfg.batch_size
    with lf.opened(lf.make_loader(ctx.prep.shards, ctx.prep.index, ctx.cfg, workers=workers, socket=socket)) as ld:
        batches = iter(ld)
        t0 = time.perf_counter()
        first = next(batches)
        first_s = time.perf_counter() - t0
        rest = time_pass(batches, warmup=0, timed=steps - 1)
    return PassTiming(samples=rest.samples + batch_size_of(first), seconds=first_s + rest.seconds, startup_s=first_s)


def p4_rows(ctx: Context, daemon_ok: str | None) -> list[Row]:
    workers = max(ctx.cfg.workers)
    title = "Cold start: first epoch, empty cache, local origin"
    if daemon_ok is not None or ctx.socket is None:
        return [Row.unavailable("P4", title, daemon_ok or "no hot cache daemon", unit="samples/s")]
    cold, hot, evicted = [], [], True
    for _ in range(ctx.cfg.repeats):
        with tempfile.TemporaryDirectory(prefix="lfb-") as tmp, \
                CacheDaemon(ctx.prep.shards, Path(tmp), ram_budget=ctx.cfg.ram_budget) as daemon:
            # Empty RAM and SSD tiers (fresh daemon) and the origin's files out of the page cache.
            evicted = lf.evict_page_cache(ctx.prep.shards, ctx.prep.index) and evicted
            cold.append(_epoch_pass(ctx, workers, daemon.socket))
        hot.append(_epoch_pass(ctx, workers, ctx.socket))  # the long-warm daemon of P1-P3, same protocol
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
    prep, cfg = ctx.prep, ctx.cfg
    cores = max(1, min(prep.transcode_workers, _cores()))
    per_core = prep.source_frames / prep.transcode_s / cores
    transcode = Row(
        id="P5/transcode", title="Preprocess cost (one-off transcode)", unit="frames/s/core",
        params={"source_frames": prep.source_frames, "episodes": cfg.episodes, "cameras": list(cfg.cameras),
                "source_resolution": [cfg.height, cfg.width], "gop": cfg.gop, "workers": prep.transcode_workers,
                "cores_counted": cores, "runs": 1},
        ours_label="loongforge preprocess (whole job, start-up included)", ours=Stat.of([per_core]),
        extra={"transcode_s": prep.transcode_s})
    transcode.notes.append("measured once per bench run (the job that made the shards), not repeated")
    w = max(cfg.workers)
    if ("p1", w) not in ctx.measured:
        return [transcode, Row.unavailable("P5/break-even", "Epochs to pay back the transcode",
                                           f"P1 at {w} workers was not measured")]
    base, ours = ctx.measured[("p1", w)]
    n = prep.index.num_samples
    saved = [n / b - n / o for b in (base.median, base.min, base.max) for o in (ours.median,)]
    epochs = [prep.transcode_s / s if s > 0 else float("inf") for s in saved]
    row = Row(id="P5/break-even", title="Epochs of training that pay back the transcode", unit="epochs",
              params={"workers": w, "samples_per_epoch": n, "transcode_s": prep.transcode_s,
                      "formula": "transcode_s / (baseline_epoch_s - loongforge_epoch_s)"},
              ours_label="break-even", ours=Stat(epochs[0], min(epochs), max(epochs), ()),
              extra={"baseline_epoch_s": n / base.median, "loongforge_epoch_s": n / ours.median})
    row.notes.append("epoch times from P1's samples/s at the same worker count; spread from the baseline's spread")
    return [transcode, row]


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
