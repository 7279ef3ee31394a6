"""`loongforge tune batch`: the largest micro-batch that fits a memory budget.

At the frame count a run trains with (K = the number of video delta indices: every
sample has K frames, so one shape is what matters; `frame_counts` measures others)
an exponential probe (1, 2, 4, ...) brackets the largest fitting micro-batch,
then bisection finds it. "Fits": on CPU, the activation bytes measured by
kernels/checkpointing.py SavedBytesProbe (a forward suffices: the bytes kept for backward are
known once it ends); on CUDA, a full forward+backward that neither raises
torch.OutOfMemoryError nor peaks above the budget in max_memory_allocated
(weights and gradients included; optimizer states, sharded by ZeRO, are not).

Measured with the chosen --ac-every and --fp8, on one rank. The JSON's
`micro_batch` (for the largest frame count measured) is what
`loongforge train --batch-plan FILE` turns into the global batch.
"""

from __future__ import annotations

import logging

import torch

from loongforge.train.kernels.checkpointing import SavedBytesProbe, apply_ac
from loongforge.train.tune.ac import measure_step
from loongforge.train.tune.results import FORMAT_VERSION

log = logging.getLogger(__name__)


def fits(w, probe, micro: int, frames: int, budget: int) -> tuple[bool, int]:
    """(fits, measured bytes) of one micro-batch size."""
    if w.device.type != "cuda":
        row = measure_step(w, probe, micro, frames, backward=False)
        return row["saved_bytes"] <= budget, row["saved_bytes"]
    try:
        row = measure_step(w, probe, micro, frames, backward=True)
    except torch.OutOfMemoryError:
        w.model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return False, -1
    return row["cuda_peak_bytes"] <= budget, row["cuda_peak_bytes"]


def largest_fit(check, limit: int, guess: int | None = None) -> tuple[int, int]:
    """Largest m in [1, limit] with check(m) true, assuming monotone; (0, bytes) when even 1 fails.
    check(m) -> (ok, bytes). Without a guess the bracket grows by doubling; with one (tune_batch's
    affine estimate) it starts there and gallops by 1, 2, 4, ... so the search never allocates
    much beyond the budget. Then bisection inside the bracket. Returns (m, bytes at m)."""
    ok, used = check(1)
    if not ok:
        return 0, used
    lo, lo_bytes, hi = 1, used, None
    if guess is not None and 1 < guess <= limit:
        ok, used = check(guess)
        if ok:
            lo, lo_bytes = guess, used
        else:
            hi = guess
    step = 1
    while hi is None:
        m = min(lo * 2 if guess is None else lo + step, limit)
        if m == lo:
            return lo, lo_bytes
        step *= 2
        ok, used = check(m)
        if ok:
            lo, lo_bytes = m, used
        else:
            hi = m
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, used = check(mid)
        if ok:
            lo, lo_bytes = mid, used
        else:
            hi = mid
    return lo, lo_bytes


def affine_guess(b1: int, b2: int, budget: int, limit: int) -> int | None:
    """Activation bytes grow ~linearly with the micro-batch: b(m) ~ b1 + (m - 1)(b2 - b1)."""
    slope = b2 - b1
    if b1 <= 0 or slope <= 0:
        return None
    return max(1, min(limit, 1 + (budget - b1) // slope))


def tune_batch(w, budget: int, *, ac_every: int = 0, limit: int = 256, frame_counts=None) -> dict:
    probe = SavedBytesProbe(w.model)
    apply_ac(w.model, ac_every, probe=probe)
    rows = []
    for k in sorted(frame_counts or (w.max_frames,)):
        check = lambda micro: fits(w, probe, micro, k, budget)  # noqa: E731
        guess = None
        if w.device.type != "cuda" and limit >= 2:  # CPU: bytes are exact, so extrapolate from 1 and 2
            guess = affine_guess(check(1)[1], check(2)[1], budget, limit)
        m, used = largest_fit(check, limit, guess)
        rows.append({"frames": k, "micro_batch": m, "bytes": used, "at_limit": m == limit})
        log.info("frames %d: micro-batch %d (%d bytes)", k, m, used)
    apply_ac(w.model, 0)
    longest = rows[-1]
    return {"version": FORMAT_VERSION, "kind": "batch", "budget_bytes": budget, "device": str(w.device),
            "ac_every": ac_every, "measure": "cuda_peak" if w.device.type == "cuda" else "saved_bytes",
            "rows": rows, "micro_batch": longest["micro_batch"], "frames": longest["frames"]}


def format_batch_table(result: dict) -> str:
    lines = [f"{'frames':>6} {'micro-batch':>12} {'MiB':>9}"]
    for r in result["rows"]:
        more = " (search limit)" if r["at_limit"] else ""
        lines.append(f"{r['frames']:>6} {r['micro_batch']:>12} {r['bytes'] / 2**20:>9.1f}{more}")
    m = result["micro_batch"]
    lines.append(f"budget {result['budget_bytes'] / 2**20:.1f} MiB, ac-every {result['ac_every'] or 'off'} -> "
                 + (f"micro-batch {m} at {result['frames']} frames (train --batch-plan FILE)" if m else
                    "not even micro-batch 1 fits: raise the budget or turn on --ac-every"))
    return "\n".join(lines)
