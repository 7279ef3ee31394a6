"""P1/rgb-conversion: the CPU NV12 -> normalized float RGB conversion alone,
the unfused reference (`nv12_to_input_reference`, the loader's conversion
before the fused one) against the fused one (`nv12_to_input`), in the same
run, interleaved batch by batch, on batches of the bench's own shape.

On a CPU-only run this conversion bounds the float RGB rows of P1: it runs in
the loader's main-process prefetch thread (on a GPU it runs on device).
Rates are frames per CPU-second of the converting process with one intra-op
thread (as the loader's prefetch thread runs it: colorspace.serial_cpu_ops_in_this_thread):
the cost per busy core, which another job taking a core on a shared
machine does not change the way it changes a wall-clock rate. The wall-clock
rates are kept in the row's `extra`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from loongforge.benchmarks.context import Context
from loongforge.benchmarks.measure import Stat, ratio
from loongforge.benchmarks.rows import Row

CONVERSION_GOAL = 3.0
UNTIMED = 3  # the allocator's first touches of the output buffers


@contextmanager
def _one_thread():
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _batch_frames(ctx: Context):
    import torch

    ds = ctx.prep.index.dataset
    b, k = ctx.cfg.batch_size, ds.frames_per_sample
    gen = torch.Generator().manual_seed(ctx.cfg.seed)
    return [torch.randint(0, 256, (b, k, ds.height * 3 // 2, ds.width), dtype=torch.uint8, generator=gen)
            for _ in ds.slots]


def measure(ctx: Context, batches: int = 15) -> dict[str, dict[str, Stat]]:
    """{"old"|"new": {"cpu": frames/CPU-s, "wall": frames/s}} over `batches` interleaved batches."""
    from loongforge.train.colorspace import nv12_to_input, nv12_to_input_reference

    ds = ctx.prep.index.dataset
    frames = _batch_frames(ctx)
    n_frames = sum(f.shape[0] * f.shape[1] for f in frames)
    fns = {"old": nv12_to_input_reference, "new": nv12_to_input}
    got = {name: {"cpu": [], "wall": []} for name in fns}
    with _one_thread():
        for i in range(UNTIMED + batches):
            for name, fn in fns.items():
                c0, t0 = time.process_time(), time.perf_counter()
                for f in frames:
                    fn(f, ds.color_matrix, ds.color_range, mean=0.5, std=0.25)
                c1, t1 = time.process_time(), time.perf_counter()
                if i >= UNTIMED:
                    got[name]["cpu"].append(n_frames / max(c1 - c0, 1e-9))
                    got[name]["wall"].append(n_frames / max(t1 - t0, 1e-9))
    return {name: {k: Stat.of(v) for k, v in d.items()} for name, d in got.items()}


def conversion_rate(ctx: Context) -> float:
    """samples/s of the loader's conversion alone (wall clock, one thread), for
    P3's note: what one batch's conversion costs the prefetch thread."""
    new = ctx.measured.get("conversion") or measure(ctx)
    ds = ctx.prep.index.dataset
    return new["new"]["wall"].median / (ds.frames_per_sample * len(ds.slots))


def conversion_row(ctx: Context) -> Row:
    m = measure(ctx)
    ctx.measured["conversion"] = m
    old, new = m["old"]["cpu"], m["new"]["cpu"]
    r = ratio(new, old)
    ds = ctx.prep.index.dataset
    row = Row(id="P1/rgb-conversion", title="CPU NV12 -> normalized float RGB, unfused vs fused",
              unit="frames/CPU-s",
              params={"resolution": [ds.height, ds.width], "frames_per_batch": ctx.cfg.batch_size *
                      ds.frames_per_sample * len(ds.slots), "batches": len(old.values), "intra_op_threads": 1,
                      "matrix": ds.color_matrix, "range": ds.color_range},
              baseline_label="train.colorspace.nv12_to_input_reference (unfused, bit-identical RGB)",
              ours_label="train.colorspace.nv12_to_input (fused; within 1 LSB, tests/train/test_colorspace.py)",
              baseline=old, ours=new, ratio=r, ratio_note="fused / unfused",
              goal=f">= {CONVERSION_GOAL:.0f}x", goal_met=r.median >= CONVERSION_GOAL,
              extra={"old_wall_frames_per_s": m["old"]["wall"], "new_wall_frames_per_s": m["new"]["wall"]})
    if not row.goal_met:
        row.notes.append(
            f"goal missed: the fused form is {r.median:.2f}x per CPU-second here (wall clock "
            f"{ratio(m['new']['wall'], m['old']['wall']).median:.2f}x); the float RGB rows of P1 carry this cost "
            "on CPU, the NV12 rows do not")
    return row
