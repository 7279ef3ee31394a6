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

    def fields(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        b, k, fr = self.batch, self.frames, (self.height * 3 // 2, self.width)
        out = [(f"frames.{s}", (b, k, *fr), np.dtype(np.uint8)) for s in self.slots]
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


@dataclass(frozen=True, slots=True)
class Norm:
    """N1.6's normalisation of state and action (Isaac-GR00T's StateActionProcessor with its defaults:
    min/max, clip_outliers): x -> 2 (x - min) / (max - min) - 1, clipped to [-1, 1]; a dimension whose
    min and max agree maps to 0. `un*` map back, clipping first, as the reference's decode_action."""

    state_min: np.ndarray | None  # None: the root recorded no min/max for it (values pass as they are)
    state_max: np.ndarray | None
    action_min: np.ndarray | None
    action_max: np.ndarray | None

    @classmethod
    def from_dataset(cls, ds) -> "Norm":
        """From a DatasetInfo (shared/index.py): the training episodes' min/max preprocess recorded."""
        st = ds.stats

        def pick(kind, key, dim):
            vals = st.get(kind, {}).get(key)
            return np.asarray(vals, np.float32) if vals is not None and len(vals) == dim else None

        return cls(pick("state", "min", ds.state_dim), pick("state", "max", ds.state_dim),
                   pick("action", "min", ds.action_dim), pick("action", "max", ds.action_dim))

    @staticmethod
    def _to(x, lo, hi):
        if lo is None or hi is None:
            return np.asarray(x, np.float32)
        span = hi - lo
        live = ~np.isclose(hi, lo)
        out = np.where(live, 2.0 * (np.asarray(x, np.float32) - lo) / np.where(live, span, 1.0) - 1.0, 0.0)
        return np.clip(out, -1.0, 1.0).astype(np.float32)

    @staticmethod
    def _from(x, lo, hi):
        if lo is None or hi is None:
            return np.asarray(x, np.float32)
        return ((np.clip(np.asarray(x, np.float32), -1.0, 1.0) + 1.0) / 2.0 * (hi - lo) + lo).astype(np.float32)

    def state(self, x):
        return self._to(x, self.state_min, self.state_max)

    def action(self, x):
        return self._to(x, self.action_min, self.action_max)

    def unstate(self, x):
        return self._from(x, self.state_min, self.state_max)

    def unaction(self, x):
        return self._from(x, self.action_min, self.action_max)


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
