"""`LeRobotLoader`: LeRobot's batches (the items of lerobot.py, collated) at LoongForge's speed.

    from loongforge.train.data.lerobot_loader import LeRobotLoader
    loader = LeRobotLoader("shards/", delta_timestamps=..., batch_size=64, num_workers=4, device="cuda")
    for batch in loader:  # {"observation.images.front": (B, 2, 3, h, w), "action": (B, 16, A), ..., "task": [...]}
        ...
    loader.state_dict() / load_state_dict(state)   # exact resume, as BlockLoader

The same keys, shapes, dtypes and values as `DataLoader(LeRobotDataset(root, delta_timestamps=...),
batch_size=B)` yields (default collate: a leading batch axis, `task` a list of strings; the epoch's
last, partial batch kept as DataLoader's drop_last=False keeps it, `drop_last=True` leaves it out), from
BlockLoader's machinery: the deterministic global order (order.py: every frame of the training
episodes once per epoch, block-aware, rank slices of a global batch), decode worker processes
that fill shared-memory slots from the block cache (workers.py), and the prefetcher that
converts NV12 to float RGB on the loader's device (CUDA: pinned buffers, side-stream copy).
Iteration runs epoch after epoch (`max_steps` stops it; `len()` is the steps of one epoch).
Samples that fail to decode raise (bad_samples="raise"): a LeRobot loop has no mask for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loongforge.shared.dataset import open_root
from loongforge.shared.errors import ConfigError, DataWorkerError, LoongForgeError
from loongforge.train.data.lerobot_items import ItemPlan, ItemReader, PyAVRGB, query
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.loader import DEFAULT_CACHE_MB, BlockLoader
from loongforge.train.data.sources import SourceSpec, make_source

FIELD_DTYPES = {"float32": "<f4", "int64": "<i8", "bool": "|b1"}  # a column's item dtype -> its batch field


@dataclass(frozen=True, slots=True)
class FieldLayout:
    """A batch as named fixed-shape arrays in one flat buffer (64-byte aligned fields), the
    interface DecodePool needs of a layout (nbytes, views)."""

    specs: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype string)

    def fields(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        return [(n, s, np.dtype(d)) for n, s, d in self.specs]

    nbytes = BatchLayout.nbytes  # the same placement of fields (batch.py)
    views = BatchLayout.views


def item_layout(plan: ItemPlan, batch: int) -> FieldLayout:
    """frames.<key> NV12 (B, K, 3h/2, w) (or rgb.<key> uint8 (B, K, h, w, 3) for colour "pyav"),
    col.<key> (B, K, *shape) or (B, *shape) per column, pad.<key> (B, K), sample_ids (B,)."""
    strings = [c.key for c in plan.columns if c.dtype == "str"]
    if strings:
        raise ConfigError(f"columns {strings} hold strings, which the fast path's fixed-size batches do not carry; "
                          "read this root with LeRobotDataset in a DataLoader")
    specs = []
    for c in plan.cameras:
        rgb = plan.color == "pyav" and c.kind == "video"
        shape = (batch, c.frames, c.height, c.width, 3) if rgb else (batch, c.frames, c.height * 3 // 2, c.width)
        specs.append((f"{'rgb' if rgb else 'frames'}.{c.key}", shape, "|u1"))
    for col in plan.columns:
        shape = (batch, col.frames, *col.shape) if col.deltas is not None else (batch, *col.shape)
        specs.append((f"col.{col.key}", shape, FIELD_DTYPES[col.dtype]))
    for p in (*plan.cameras, *plan.columns):
        if p.deltas is not None:
            specs.append((f"pad.{p.key}", (batch, len(p.deltas)), "|b1"))
    specs += [("task_row", (batch,), "<i8"), ("sample_valid", (batch,), "|b1"), ("sample_ids", (batch,), "<i8")]
    return FieldLayout(tuple(specs))


@dataclass(frozen=True, slots=True)
class ItemFillerSpec:
    """What a decode worker needs to fill LeRobot batches; picklable (spawned workers)."""

    root: str
    plan: ItemPlan
    layout: FieldLayout
    cache_bytes: int
    source: SourceSpec | None = None

    def open(self) -> "ItemFiller":
        factory = None
        if self.source is not None and self.source.wants_cache:
            spec = self.source
            factory = lambda shard_index: make_source(spec, shard_index)  # noqa: E731 - needs the shard list
        return ItemFiller(ItemReader(open_root(self.root, source=factory), self.cache_bytes), self.plan)


class ItemFiller:
    def __init__(self, reader: ItemReader, plan: ItemPlan):
        self.reader, self.plan, self.samples = reader, plan, 0
        self.pyav = PyAVRGB() if plan.color == "pyav" else None

    def counters(self) -> dict:
        return {**self.reader.cache.counters(), "samples": self.samples}

    def close(self) -> None:
        self.reader.cache.clear()

    def fill(self, arrays: dict, items, policy: str) -> tuple[int, list[str]]:
        for row, (gid, e, t) in enumerate(items):
            arrays["sample_ids"][row] = gid
            try:
                self._fill_row(arrays, row, int(e), int(t))
            except LoongForgeError as exc:  # no mask in a LeRobot batch: a bad sample stops the loop
                raise DataWorkerError(f"sample {gid} (episode row {e}, t {t}): {type(exc).__name__}: {exc}") from exc
            arrays["sample_valid"][row] = True
            self.samples += 1
        return 0, []

    def _fill_row(self, arrays: dict, row: int, e: int, t: int) -> None:
        reader, plan = self.reader, self.plan
        ep, length = reader.arrays(e), int(reader.ds.episode_lengths[e])
        for c in plan.cameras:
            rows, pad = query(c.deltas, t, length)
            if f"rgb.{c.key}" in arrays:
                arrays[f"rgb.{c.key}"][row] = self.pyav(reader.frames(e, c.column, rows), plan.matrix,
                                                        plan.color_range)
            else:
                reader.frames(e, c.column, rows, out=arrays[f"frames.{c.key}"][row])
            if c.deltas is not None:
                arrays[f"pad.{c.key}"][row] = pad
        for col in plan.columns:
            rows, pad = query(col.deltas, t, length)
            values = reader.column(e, col, rows, ep)
            arrays[f"col.{col.key}"][row] = values if col.deltas is not None else values[0]
            if col.deltas is not None:
                arrays[f"pad.{col.key}"][row] = pad
        arrays["task_row"][row] = ep[plan.task_array][t]


class LeRobotLoader(BlockLoader):
    def __init__(self, root: str, *, delta_timestamps: dict | None = None, batch_size: int, num_workers: int = 0,
                 seed: int = 0, rank: int = 0, world: int = 1, device: str | torch.device = "cpu",
                 color: str = "loongforge", split: str = "train", tolerance_s: float = 1e-4,
                 block_cache_mb: float = DEFAULT_CACHE_MB, prefetch: int = 2, max_steps: int | None = None,
                 timeout_s: float = 120.0, start_method: str = "spawn", source: SourceSpec | None = None,
                 drop_last: bool = False, **order):
        ds = open_root(root)
        if split not in ("train", "all"):
            raise ConfigError(f"split={split!r}: the fast path reads 'train' (the training split) or 'all'")
        self.items = ItemPlan.build(ds.info, delta_timestamps, tolerance_s=tolerance_s, color=color)
        self.tasks = {int(k): v for k, v in (ds.info.tasks or {}).items()}
        # image_mean 0, image_std 1: the prefetcher's NV12 -> input pass gives RGB / 255, LeRobot's [0, 1] floats.
        super().__init__(root, batch_size=batch_size, num_workers=num_workers, seed=seed, rank=rank, world=world,
                         dataset=ds, device=device, rgb=True, block_cache_mb=block_cache_mb, bad_samples="raise",
                         prefetch=prefetch, max_steps=max_steps, timeout_s=timeout_s, start_method=start_method,
                         image_mean=0.0, image_std=1.0, train_only=split == "train", source=source,
                         drop_last=drop_last, **order)

    def _filler(self, root: str, per_rank: int, max_text_tokens: int, cache_bytes: int) -> ItemFillerSpec:
        return ItemFillerSpec(root, self.items, item_layout(self.items, per_rank), cache_bytes, self.source_spec)

    def _order_key(self) -> dict:
        return {**super()._order_key(), "delta_indices": self.items.key_deltas(), "color": self.items.color}

    def __len__(self) -> int:
        """Steps (batches of this rank) per epoch: ceil(samples / batch_size), as a DataLoader's len(),
        or the full batches alone with drop_last=True."""
        return self.plan.steps

    def __next__(self) -> dict:
        raw = super().__next__()
        return self._lerobot_batch(raw)

    def _lerobot_batch(self, raw: dict) -> dict:
        rows = len(raw["meta"]["sample_ids"])  # fewer than the slot's rows in an epoch's kept tail
        if rows < len(raw["sample_ids"]):
            raw = {k: (v if k == "meta" else {c: x[:rows] for c, x in v.items()} if k == "frames" else v[:rows])
                   for k, v in raw.items()}
        plan, frames, out = self.items, raw["frames"], {}
        for c in plan.cameras:
            x = frames.get(c.key)
            if x is None:  # colour "pyav": uint8 RGB made in the worker, to [0, 1] floats here (on the device)
                x = raw[f"rgb.{c.key}"].permute(0, 1, 4, 2, 3).float().div_(255)
            out[c.key] = x[:, 0] if c.squeeze else x
        for col in plan.columns:
            out[col.key] = raw[f"col.{col.key}"]
        for p in (*plan.cameras, *plan.columns):
            if p.deltas is not None:
                out[f"{p.key}_is_pad"] = raw[f"pad.{p.key}"]
        out["task"] = [self.tasks.get(int(i), "") for i in raw["task_row"].tolist()]
        return out
