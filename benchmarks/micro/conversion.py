"""P1/rgb-conversion: the CPU NV12 -> normalized float RGB conversion alone,
the unfused reference (`nv12_to_input_reference`, the loader's conversion
before the fused one) against the loader's (`nv12_to_input`: one numba pass on
CPU, colorspace_jit) and the fused torch ops it falls back to without numba
(`nv12_to_input_ops`, the "ops" figures in `extra`), in the same run,
interleaved batch by batch, on batches of the bench's own shape.

On a CPU-only run this conversion bounds the float RGB rows of P1: it runs in
the loader's main-process prefetch thread (on a GPU it runs on device).
Rates are frames per CPU-second of the converting process with one intra-op
thread (as the loader's prefetch thread runs it: colorspace.serial_cpu_ops_in_this_thread):
the cost per busy core, which another job taking a core on a shared
machine does not change the way it changes a wall-clock rate. The wall-clock
rates are kept in the row's `extra`.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

from loongforge.benchmarks.harness.context import Context
from loongforge.benchmarks.harness.measure import Stat, ratio
from loongforge.benchmarks.harness.rows import Row

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
    ds = ctx.prep.info
    return random_batches(ctx.cfg.batch_size * ds.frames_per_sample, ds.height, ds.width, len(ds.slots), ctx.cfg.seed)


def random_batches(frames: int, height: int, width: int, batches: int = 1, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (frames, height * 3 // 2, width), dtype=torch.uint8, generator=gen)
            for _ in range(batches)]


def measure(ctx: Context, batches: int = 15) -> dict[str, dict[str, Stat]]:
    """{"old"|"ops"|"new": {"cpu": frames/CPU-s, "wall": frames/s}} over `batches` interleaved batches."""
    ds = ctx.prep.info
    return measure_frames(_batch_frames(ctx), ds.color_matrix, ds.color_range, batches)


def measure_frames(frames: list, matrix: str, color_range: str, batches: int = 15, fns: dict | None = None):
    """The same, on given NV12 batches; `fns` maps a name to a conversion (default old/ops/new)."""
    from loongforge.train.data import colorspace_jit
    from loongforge.train.data.colorspace import nv12_to_input, nv12_to_input_ops, nv12_to_input_reference

    colorspace_jit.warm_up()  # as the loader does at start: the compile is not a timed round's
    n_frames = sum(f[..., 0, 0].numel() for f in frames)
    fns = fns or {"old": nv12_to_input_reference, "ops": nv12_to_input_ops, "new": nv12_to_input}
    got = {name: {"cpu": [], "wall": []} for name in fns}
    with _one_thread():
        for i in range(UNTIMED + batches):
            for name, fn in fns.items():
                c0, t0 = time.process_time(), time.perf_counter()
                for f in frames:
                    fn(f, matrix, color_range, mean=0.5, std=0.25)
                c1, t1 = time.process_time(), time.perf_counter()
                if i >= UNTIMED:
                    got[name]["cpu"].append(n_frames / max(c1 - c0, 1e-9))
                    got[name]["wall"].append(n_frames / max(t1 - t0, 1e-9))
    return {name: {k: Stat.of(v) for k, v in d.items()} for name, d in got.items()}


def conversion_rate(ctx: Context) -> float:
    """samples/s of the loader's conversion alone (wall clock, one thread), for
    P3's note: what one batch's conversion costs the prefetch thread."""
    new = ctx.measured.get("conversion") or measure(ctx)
    ds = ctx.prep.info
    return new["new"]["wall"].median / (ds.frames_per_sample * len(ds.slots))


def conversion_row(ctx: Context) -> Row:
    from loongforge.train.data import colorspace_jit

    m = measure(ctx)
    ctx.measured["conversion"] = m
    old, new = m["old"]["cpu"], m["new"]["cpu"]
    r = ratio(new, old)
    ds = ctx.prep.info
    jit = colorspace_jit.available()
    new_label = ("train.colorspace.nv12_to_input: one numba pass (colorspace_jit), bit-identical" if jit else
                 "train.colorspace.nv12_to_input: fused torch ops (numba not available), within 1 LSB")
    row = Row(id="P1/rgb-conversion", title="CPU NV12 -> normalized float RGB, unfused vs fused",
              unit="frames/CPU-s",
              params={"resolution": [ds.height, ds.width], "frames_per_batch": ctx.cfg.batch_size *
                      ds.frames_per_sample * len(ds.slots), "batches": len(old.values), "intra_op_threads": 1,
                      "matrix": ds.color_matrix, "range": ds.color_range, "numba": jit},
              baseline_label="train.colorspace.nv12_to_input_reference (unfused, bit-identical RGB)",
              ours_label=new_label + " (tests/train/data/test_colorspace.py)",
              baseline=old, ours=new, ratio=r, ratio_note="fused / unfused",
              goal=f">= {CONVERSION_GOAL:.0f}x", goal_met=r.median >= CONVERSION_GOAL,
              extra={"old_wall_frames_per_s": m["old"]["wall"], "new_wall_frames_per_s": m["new"]["wall"],
                     "ops_frames_per_cpu_s": m["ops"]["cpu"], "ops_wall_frames_per_s": m["ops"]["wall"],
                     "ops_over_old": ratio(m["ops"]["cpu"], old), "kernel_warm_up_s": colorspace_jit.warm_up()})
    if not row.goal_met:
        row.notes.append(
            f"goal missed: the loader's conversion ({'numba' if jit else 'torch ops'}) is {r.median:.2f}x per "
            f"CPU-second here (wall clock {ratio(m['new']['wall'], m['old']['wall']).median:.2f}x); the float RGB "
            "rows of P1 carry this cost on CPU, the NV12 rows do not")
    return row


def output_passes_only(nv12, matrix: str, color_range: str, *, mean: float, std: float):
    """What no torch-op design of the conversion avoids, and nothing else: the float output written
    once and then clamped, rounded and normalized in place (4 passes over 12 bytes per pixel), in the
    same slices as `nv12_to_input`'s output passes. Its rate bounds the conversion's: the chroma and luma work
    (~1.5 bytes per pixel in) is what the fused form adds on top."""
    import torch

    from loongforge.train.data import colorspace

    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    n = nv12[..., 0, 0].numel()
    out = torch.empty(n, 3, h, w)
    shift = torch.tensor(-mean / std)
    step = max(1, min(n, colorspace.OUT_PX // (h * w)))
    for s in range(0, n, step):
        o = out[s:s + step]
        o.fill_(100.25)
        o.clamp_(0.0, 255.0).round_()
        torch.add(shift, o, alpha=1.0 / (255.0 * std), out=o)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The row alone, without preparing a dataset (what benchmarks/README.md quotes):
    loongforge bench conversion --size 256 --frames 32 --batches 15"""
    p.add_argument("--size", type=int, default=256, help="frame height and width")
    p.add_argument("--frames", type=int, default=32, help="frames per batch (bench: batch 8 x K 4)")
    p.add_argument("--batches", type=int, default=15, help="timed rounds, all conversions interleaved")
    p.add_argument("--matrix", default="bt601")
    p.add_argument("--range", dest="color_range", default="limited")


def handle(a: argparse.Namespace) -> int:
    from loongforge.train.data import colorspace_jit
    from loongforge.train.data.colorspace import nv12_to_input, nv12_to_input_ops, nv12_to_input_reference

    fns = {"old": nv12_to_input_reference, "ops": nv12_to_input_ops, "new": nv12_to_input,
           "floor": output_passes_only}
    load0 = os.getloadavg()[0]
    m = measure_frames(random_batches(a.frames, a.size, a.size), a.matrix, a.color_range, a.batches, fns)
    old = m["old"]["cpu"]
    print(f"{a.size}x{a.size}, {a.frames} frames/batch, {a.batches} rounds, 1 intra-op thread, "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; new = "
          f"{'numba pass' if colorspace_jit.available() else 'torch ops (no numba)'}, "
          f"kernel warm-up {colorspace_jit.warm_up() or 0:.2f} s")
    for name in m:
        per_round = Stat.of(x / y for x, y in zip(m[name]["cpu"].values, old.values))  # same round, same load
        print(f"  {name}: {m[name]['cpu'].median:,.0f} frames/CPU-s, {m[name]['wall'].median:,.0f} frames/s wall, "
              f"{per_round.median:.2f}x old [{per_round.min:.2f}-{per_round.max:.2f} over rounds]")
    print(f"  new / old: {ratio(m['new']['cpu'], old).median:.2f}x per CPU-second "
          f"(goal >= {CONVERSION_GOAL:.0f}x), {ratio(m['new']['wall'], m['old']['wall']).median:.2f}x wall")
    print(f"  floor / old: {ratio(m['floor']['cpu'], old).median:.2f}x: the output passes alone, the most any "
          "design with separate torch ops can reach")
    return 0
