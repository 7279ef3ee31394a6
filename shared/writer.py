"""Writing a shard root: episode fragments -> shards -> tables -> manifest.

The same functions serve the Beam job (preprocess/stages/pack.py stages fragments per
episode and writes shards in parallel, then finalize publishes) and the
in-process `RootWriter` used by `loongforge convert`, tests and benchmarks.
Publishing order: shards, then tables, then `index.json` last (atomic temp +
rename each), so a root with an index is complete.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable

import numpy as np

from loongforge.shared import paths, storage
from loongforge.shared.blocks import (BLOCK_CODECS, DEFAULT_BLOCK_CODEC, EpisodeLayout, block_codec_param,
                                      encode_episode)
from loongforge.shared.errors import ConfigError, FormatError
from loongforge.shared.index import TABLES, DatasetInfo, bucket_shift, frame_buckets, manifest_json, table_name
from loongforge.shared.members import DEFAULT_ZSTD_LEVEL, END_OF_ARCHIVE

DEFAULT_BLOCK_FRAMES = 16  # chosen by `loongforge bench storage` (benchmarks/README.md)


def plan_episode_shards(sizes: Iterable[tuple[int, int]], shard_size: int) -> list[list[int]]:
    """(episode, fragment bytes) in global order -> episodes per shard. Greedy and
    deterministic; an episode never spans shards (one larger than shard_size gets its own)."""
    plans: list[list[int]] = []
    current: list[int] = []
    size = len(END_OF_ARCHIVE)
    for episode, length in sizes:
        if current and size + length > shard_size:
            plans.append(current)
            current, size = [], len(END_OF_ARCHIVE)
        current.append(episode)
        size += length
    if current:
        plans.append(current)
    return plans


def write_shard(root: str, number: int, fragments: Iterable[tuple[EpisodeLayout, bytes | memoryview]]
                   ) -> tuple[dict, list[EpisodeLayout]]:
    """Concatenate episode fragments into shard `number` (atomic); returns its manifest
    entry and the layouts with shard offsets."""
    name = paths.shard_name(number)
    h = hashlib.sha256()
    placed, pos = [], 0
    with storage.open_atomic(paths.join(root, name)) as f:
        for layout, frag in fragments:
            if len(frag) != layout.length:
                raise FormatError(f"episode {layout.episode}: staged fragment has {len(frag)} bytes, "
                                  f"its layout says {layout.length}")
            f.write(frag)
            h.update(frag)
            placed.append(layout.shifted(pos))
            pos += len(frag)
        f.write(END_OF_ARCHIVE)
        h.update(END_OF_ARCHIVE)
        pos += len(END_OF_ARCHIVE)
    return {"name": name, "bytes": pos, "sha256": h.hexdigest()}, placed


def build_tables(layouts: list[EpisodeLayout], shard_of: list[int], cameras: int) -> dict[str, np.ndarray]:
    """Per-episode and per-block tables from shard-placed layouts, in global episode order."""
    e = len(layouts)
    lengths = np.array([lay.num_frames for lay in layouts], np.int64)
    start = np.zeros(e + 1, np.int64)
    np.cumsum(lengths, out=start[1:])
    nb = sum(len(cam) for lay in layouts for cam in lay.blocks)
    blocks = np.empty((nb, 4), np.uint64)
    first = np.empty((e, cameras), np.int64)
    row = 0
    for i, lay in enumerate(layouts):
        if len(lay.blocks) != cameras:
            raise FormatError(f"episode {lay.episode}: {len(lay.blocks)} cameras, the dataset has {cameras}")
        for c, cam in enumerate(lay.blocks):
            first[i, c] = row
            blocks[row:row + len(cam)] = np.array(cam, np.uint64).reshape(len(cam), 4)
            row += len(cam)
    shift = bucket_shift(lengths)
    return {
        "frame_bucket": frame_buckets(start, shift),
        "episode_id": np.array([lay.episode for lay in layouts], np.int64),
        "episode_shard": np.asarray(shard_of, np.int32),
        "episode_length": lengths,
        "episode_start": start,
        "episode_arrays": np.array([lay.arrays for lay in layouts], np.uint64).reshape(e, 3),
        "first_block": first,
        "blocks": blocks,
    }


def write_tables(root: str, tables: dict[str, np.ndarray]) -> dict[str, dict]:
    """Write each table as .npy (atomic); returns the manifest's `tables` entries."""
    out = {}
    for name in sorted(tables):
        arr = np.ascontiguousarray(tables[name], dtype=np.dtype(TABLES[name][0]))
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        data = buf.getvalue()
        storage.write_bytes_atomic(paths.join(root, table_name(name)), data)
        out[name] = {"name": table_name(name), "bytes": len(data), "sha256": storage.sha256_of(data),
                     "dtype": arr.dtype.str, "shape": list(arr.shape)}
    return out


def publish(root: str, *, dataset: DatasetInfo, params: dict, shards: list[dict], layouts: list[EpisodeLayout],
               shard_of: list[int], failed=(), val_episodes=(), created_by: str = "") -> bytes:
    """Tables, then index.json LAST. `layouts` in global order, offsets within their shards."""
    ids = [lay.episode for lay in layouts]
    if len(set(ids)) != len(ids):
        raise FormatError("an episode id appears twice: member names and the index need unique ids")
    tables = build_tables(layouts, shard_of, len(dataset.cameras))
    entries = write_tables(root, tables)
    manifest = manifest_json(dataset=dataset, params=params, shards=shards, tables=entries, episodes=len(layouts),
                             frames=int(tables["episode_start"][-1]), blocks=len(tables["blocks"]),
                             bucket_shift=bucket_shift(tables["episode_length"]), failed=failed,
                             val_episodes=val_episodes, created_by=created_by)
    storage.write_bytes_atomic(paths.join(root, paths.INDEX_FILE), manifest)
    return manifest


class RootWriter:
    """In-process writer: add episodes in global order, then `close()` publishes.

        with RootWriter(root, dataset, block_size=16) as w:
            w.add_episode(7, {"ego_view": nv12}, {"state": s, "action": a, ...})
    """

    def __init__(self, root: str, dataset: DatasetInfo, *, block_size: int = DEFAULT_BLOCK_FRAMES,
                 zstd_level: int = DEFAULT_ZSTD_LEVEL, shard_size: int = 64 << 20, params: dict | None = None,
                 created_by: str = "loongforge.shared.writer", block_codec: str = DEFAULT_BLOCK_CODEC):
        if block_size < 1:
            raise FormatError(f"block_size={block_size}: must be >= 1")
        if block_codec not in BLOCK_CODECS:
            raise ConfigError(f"block_codec={block_codec!r}: choose one of {BLOCK_CODECS}")
        self.block_codec = block_codec
        self.root, self.dataset = root, dataset
        self.block_size, self.zstd_level, self.shard_size = block_size, zstd_level, shard_size
        self.params = {**(params or {}), "block_size": block_size, "zstd_level": zstd_level, "shard_size": shard_size,
                       **block_codec_param(block_codec)}
        self.created_by = created_by
        self._pending: list[tuple[EpisodeLayout, bytes]] = []
        self._pending_bytes = len(END_OF_ARCHIVE)
        self.shards: list[dict] = []
        self.layouts: list[EpisodeLayout] = []
        self.shard_of: list[int] = []
        self.failed: list[dict] = []

    def add_episode(self, episode: int, frames: dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> EpisodeLayout:
        buf = io.BytesIO()
        layout = encode_episode(buf, episode, frames, arrays, slots=self.dataset.slots, block_size=self.block_size,
                                zstd_level=self.zstd_level, codec=self.block_codec)
        if self._pending and self._pending_bytes + layout.length > self.shard_size:
            self._flush()
        self._pending.append((layout, buf.getvalue()))
        self._pending_bytes += layout.length
        return layout

    def _flush(self) -> None:
        if not self._pending:
            return
        entry, placed = write_shard(self.root, len(self.shards), self._pending)
        self.shard_of += [len(self.shards)] * len(placed)
        self.shards.append(entry)
        self.layouts += placed
        self._pending, self._pending_bytes = [], len(END_OF_ARCHIVE)

    def close(self, *, val_episodes=(), failed=None) -> bytes:
        self._flush()
        return publish(self.root, dataset=self.dataset, params=self.params, shards=self.shards,
                          layouts=self.layouts, shard_of=self.shard_of, failed=failed or self.failed,
                          val_episodes=val_episodes, created_by=self.created_by)

    def __enter__(self) -> "RootWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
