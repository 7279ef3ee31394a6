"""The fixed memory layout of one per-rank batch, and the bad-sample policy of filling one.

A batch lives in one flat byte buffer (a shared-memory slot when decode workers
run, a plain array inline). Every sample has the same shape: K frames per camera
(K = the number of video delta indices, fixed for a run), so one layout serves
every batch and the allocator and kernels settle after the first step.
`frame_mask` is all True for a good sample and all False for a bad one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import DataWorkerError, LoongForgeError

PAD, BOS, EOS = 256, 257, 258  # byte-level tokenizer: ids 0..255 are the UTF-8 bytes


def encode_text(text: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)[: max(0, length - 2)]
    ids = np.full(length, PAD, np.int64)
    ids[0] = BOS
    ids[1:1 + len(raw)] = raw
    if 1 + len(raw) < length:
        ids[1 + len(raw)] = EOS
    return ids, ids != PAD


@dataclass(frozen=True, slots=True)
class BatchLayout:
    batch: int  # per-rank micro batch
    slots: tuple[str, ...]  # camera slots
    height: int
    width: int
    frames: int  # K per camera
    state_dim: int
    action_dim: int
    horizon: int
    text_len: int
    sizes: tuple[tuple[int, int], ...] = ()  # per slot its (h, w) when cameras differ; () = all height x width
    raw_state_dim: int = 0  # > 0: the raw state and action ride along (evaluation, inspect), in key order
    raw_action_dim: int = 0

    def size(self, slot: int) -> tuple[int, int]:
        return self.sizes[slot] if self.sizes else (self.height, self.width)

    def fields(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        b, k = self.batch, self.frames
        out = [(f"frames.{s}", (b, k, self.size(i)[0] * 3 // 2, self.size(i)[1]), np.dtype(np.uint8))
               for i, s in enumerate(self.slots)]
        if self.raw_state_dim:
            out += [("raw_state", (b, k, self.raw_state_dim), np.dtype(np.float32)),
                    ("raw_action", (b, self.horizon, self.raw_action_dim), np.dtype(np.float32))]
        return out + [
            ("state", (b, k, self.state_dim), np.dtype(np.float32)),
            ("action", (b, self.horizon, self.action_dim), np.dtype(np.float32)),
            ("action_valid", (b, self.horizon), np.dtype(np.bool_)),
            ("frame_mask", (b, k), np.dtype(np.bool_)),
            ("task_tokens", (b, self.text_len), np.dtype(np.int64)),
            ("task_mask", (b, self.text_len), np.dtype(np.bool_)),
            ("sample_valid", (b,), np.dtype(np.bool_)),
            ("sample_ids", (b,), np.dtype(np.int64)),
        ]

    @property
    def nbytes(self) -> int:
        return _placement(self)[1]

    def views(self, buf) -> dict[str, np.ndarray]:
        """The batch's arrays over `buf` (at least `nbytes`), each contiguous."""
        return {name: np.frombuffer(buf, dtype=dtype, count=count, offset=pos).reshape(shape)
                for name, shape, dtype, count, pos in _placement(self)[0]}


@functools.lru_cache(maxsize=64)
def _placement(layout: BatchLayout) -> tuple[tuple, int]:
    """((name, shape, dtype, count, byte offset) per field, total bytes): fields 64-byte aligned.
    Computed once per layout: views() runs for every batch."""
    out, pos = [], 0
    for name, shape, dtype in layout.fields():
        count = math.prod(shape)
        out.append((name, shape, dtype, count, pos))
        pos += (count * dtype.itemsize + 63) // 64 * 64
    return tuple(out), pos


def fill_rows(arrays: dict[str, np.ndarray], items, policy: str, fill_row, where) -> tuple[int, list[str]]:
    """The bad-sample policy: `fill_row(row, item)` fills one row from
    item = (global sample id, ...); a LoongForgeError there re-raises as DataWorkerError
    under policy 'raise', else the row is masked out and counted. `where(item)` names the
    sample in the reason. Returns (bad samples skipped, their reasons)."""
    bad, reasons = 0, []
    for row, item in enumerate(items):
        gid = item[0]
        arrays["sample_ids"][row] = gid
        try:
            fill_row(row, item)
            arrays["sample_valid"][row] = True
        except LoongForgeError as exc:
            reason = f"sample {gid} ({where(item)}): {type(exc).__name__}: {exc}"
            if policy == "raise":
                raise DataWorkerError(f"bad sample with data.bad_samples='raise': {reason}") from exc
            bad += 1
            reasons.append(reason)
            # Keep the row (fixed shapes, same step count on every rank) but mask it out of the loss, with
            # finite values: a reused slot may hold anything, and NaN * 0 is still NaN in a masked loss.
            arrays["sample_valid"][row] = False
            arrays["state"][row] = 0
            arrays["action"][row] = 0
            arrays["frame_mask"][row] = False
            arrays["action_valid"][row] = False
    return bad, reasons
