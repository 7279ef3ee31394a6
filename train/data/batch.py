"""The fixed memory layout of one per-rank batch, and how one batch is filled.

A batch lives in one flat byte buffer (a shared-memory slot when decode workers
run, a plain array inline). Frame counts vary per sample; they are padded up to
the next length bucket so only a few shapes ever reach the model and the
allocator and kernels settle after warm-up. `frame_mask` marks real frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import DataWorkerError, FormatError, LoongForgeError
from loongforge.shared.format import SampleParts, decompress_into
from loongforge.shared.index import ShardIndex

PAD, BOS, EOS = 256, 257, 258  # byte-level tokenizer: ids 0..255 are the UTF-8 bytes


def encode_text(text: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)[: max(0, length - 2)]
    ids = np.full(length, PAD, np.int64)
    ids[0] = BOS
    ids[1:1 + len(raw)] = raw
    if 1 + len(raw) < length:
        ids[1 + len(raw)] = EOS
    return ids, ids != PAD


def default_buckets(max_frames: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_frames:
        out.append(b)
        b *= 2
    return tuple(out + [max_frames])


def bucket_for(frames: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if frames <= b:
            return b
    raise DataWorkerError(f"a sample has {frames} frames, above the largest bucket {buckets[-1]}; "
                          "add a bucket (data.frame_buckets)")


@dataclass(frozen=True, slots=True)
class BatchLayout:
    batch: int  # per-rank micro batch
    slots: tuple[str, ...]  # camera slots
    height: int
    width: int
    max_frames: int
    state_dim: int
    action_dim: int
    horizon: int
    text_len: int

    @classmethod
    def from_index(cls, index: ShardIndex, batch: int, text_len: int, max_frames: int) -> "BatchLayout":
        ds = index.dataset
        return cls(batch, tuple(ds.slots), ds.height, ds.width, max_frames, ds.state_dim, ds.action_dim,
                   ds.action_horizon, text_len)

    def fields(self, k: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        b, fr = self.batch, (self.height * 3 // 2, self.width)
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

    @staticmethod
    def _region(shape, dtype) -> int:
        return (int(np.prod(shape)) * dtype.itemsize + 63) // 64 * 64  # 64-byte aligned fields

    @property
    def nbytes(self) -> int:
        # Sized for the largest bucket; a smaller bucket uses a prefix of each region.
        return sum(self._region(s, d) for _, s, d in self.fields(self.max_frames))

    def views(self, buf, k: int) -> dict[str, np.ndarray]:
        """Contiguous arrays of bucket `k` over `buf` (regions laid out for max_frames)."""
        out, pos = {}, 0
        for (name, shape, dtype), (_, full, _) in zip(self.fields(k), self.fields(self.max_frames)):
            count = int(np.prod(shape))
            out[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).reshape(shape)
            pos += self._region(full, dtype)
        return out


@dataclass(frozen=True, slots=True)
class Norm:
    state_mean: np.ndarray
    state_std: np.ndarray
    action_mean: np.ndarray
    action_std: np.ndarray

    @classmethod
    def from_index(cls, index: ShardIndex) -> "Norm":
        return cls.from_dataset(index.dataset)

    @classmethod
    def from_dataset(cls, ds) -> "Norm":
        """From a DatasetInfo (v1 index or v2 manifest: the same stats)."""
        st = ds.stats

        def pick(kind, key, dim, default):
            vals = st.get(kind, {}).get(key)
            arr = np.asarray(vals if vals is not None and len(vals) == dim else [default] * dim, np.float32)
            return np.maximum(arr, 1e-6) if key == "std" else arr

        return cls(pick("state", "mean", ds.state_dim, 0.0), pick("state", "std", ds.state_dim, 1.0),
                   pick("action", "mean", ds.action_dim, 0.0), pick("action", "std", ds.action_dim, 1.0))


def fill_batch(source, index: ShardIndex, layout: BatchLayout, norm: Norm, arrays: dict[str, np.ndarray],
               items: list[tuple[int, int, int]], policy: str) -> tuple[int, list[str]]:
    """Decode `items` = [(global sample, shard no, local no)] into `arrays`.
    Returns (bad samples skipped, their reasons). policy 'raise' re-raises the first."""
    arrays["frame_mask"][:] = False
    return fill_rows(arrays, items, policy,
                     lambda row, item: _fill_row(source, index, layout, norm, arrays, row, item[1], item[2]),
                     lambda item: f"{index.shards[item[1]].name}#{item[2]}")


def fill_rows(arrays: dict[str, np.ndarray], items, policy: str, fill_row, where) -> tuple[int, list[str]]:
    """The bad-sample policy of both formats: `fill_row(row, item)` fills one row from
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
            # Keep the row (fixed shapes, same step count on every rank) but mask it out of the loss.
            arrays["sample_valid"][row] = False
            arrays["frame_mask"][row] = False
            arrays["action_valid"][row] = False
    return bad, reasons


def _fill_row(source, index, layout, norm, arrays, row, shard_no, local) -> None:
    entry = index.shards[shard_no]
    data = source.read_range(entry.name, entry.offsets[local], entry.lengths[local])
    entry.check_sample(local, data)  # IntegrityError -> the bad-sample policy (skip counts it, raise stops)
    parts = SampleParts(data)
    k = int(parts.meta["num_frames"])
    kb = arrays["frame_mask"].shape[1]
    if k > kb or k != entry.frames[local]:
        raise DataWorkerError(f"{parts.key}: {k} frames but the index says {entry.frames[local]} (bucket {kb})")
    for slot in layout.slots:
        dst = arrays[f"frames.{slot}"][row]
        decompress_into(parts.frames_blob(slot), dst[:k])
        if k < kb:
            dst[k:] = 0
    state = parts.array("state")
    action = parts.array("action")
    if state.shape != (k, layout.state_dim) or action.shape != (layout.horizon, layout.action_dim):
        raise FormatError(f"{parts.key}: state {state.shape} / action {action.shape} do not match the index")
    arrays["state"][row, :k] = (state - norm.state_mean) / norm.state_std
    arrays["state"][row, k:] = 0
    arrays["action"][row] = (action - norm.action_mean) / norm.action_std
    valid = int(parts.meta.get("action_valid", layout.horizon))
    arrays["action_valid"][row] = np.arange(layout.horizon) < valid
    arrays["frame_mask"][row, :k] = True
    text = bytes(parts.members.get("task.txt", b"")).decode("utf-8", errors="replace")
    ids, mask = encode_text(text, layout.text_len)
    arrays["task_tokens"][row] = ids
    arrays["task_mask"][row] = mask
