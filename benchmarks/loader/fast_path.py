"""LoongForge's side of the comparison: the trainer's `ShardLoader` reading shards
through the cache daemon, and the physical limit of that path (raw zstd).
"""

from __future__ import annotations

import importlib.util
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.shared.format import SampleParts, decompress_into
from loongforge.shared.index import ShardIndex
from loongforge.shared.source import OriginSource


def cache_status() -> str | None:
    """None if the cache client and daemon are installed, else why not."""
    for module in ("loongforge.cache.client", "loongforge.cache.cli"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} does not exist yet"
        except ImportError as exc:
            return f"{module} not importable ({exc})"
    return None


def loader_status() -> str | None:
    try:
        if importlib.util.find_spec("loongforge.train.data.loader_v1") is None:
            return "loongforge.train.data.loader_v1 does not exist yet"
    except ImportError as exc:
        return f"loongforge.train.data.loader_v1 not importable ({exc})"
    return None


def make_loader(root: str, index: ShardIndex, cfg: BenchConfig, *, workers: int, socket: str | None,
                rgb: bool = True):
    """The loader exactly as the trainer builds it (global batch = batch_size, one rank).
    rgb=True returns normalized float RGB, the same thing the baseline returns."""
    from loongforge.train.data.loader_v1 import ShardLoader
    from loongforge.train.data.sources import SourceSpec

    spec = SourceSpec(root=root, cache_socket=socket)
    return ShardLoader(root, batch_size=cfg.batch_size, num_workers=workers, seed=cfg.seed, index=index,
                       source=spec, device="cpu", rgb=rgb)


def make_loader_v2(root: str, cfg: BenchConfig, *, workers: int, socket: str | None, rgb: bool = False):
    """The format-2 loader as the trainer builds it, shaped like the v1 windows: K frames per camera
    at video deltas -(K-1)..0, a sample every `stride` timesteps, the same batch, seed and workers;
    block order and per-worker block cache at their defaults (what a user gets)."""
    from loongforge.train.data.loader import BlockLoader
    from loongforge.train.data.samples import DeltaSpec
    from loongforge.train.data.sources import SourceSpec

    k = cfg.frames_per_sample
    deltas = DeltaSpec(video=tuple(range(1 - k, 1)), action_horizon=cfg.action_horizon)
    return BlockLoader(root, batch_size=cfg.batch_size, num_workers=workers, seed=cfg.seed, deltas=deltas,
                       stride=cfg.stride, device="cpu", rgb=rgb, source=SourceSpec(root=root, cache_socket=socket))


@contextmanager
def opened(loader):
    try:
        yield loader
    finally:
        loader.close()


def warm_cache(root: str, index: ShardIndex, socket: str) -> dict:
    """Read every shard once through the daemon so the next reads are RAM-tier hits.
    Returns what the client reports about where the bytes came from."""
    from loongforge.train.data.sources import SourceSpec, close_source, make_source

    source = make_source(SourceSpec(root=root, cache_socket=socket), index)
    try:
        if isinstance(source, OriginSource):
            raise RuntimeError("the cache client fell back to the origin: the daemon is not serving")
        for entry in index.shards:
            source.read_shard(entry.name)
        stats = getattr(source, "stats", None)
        got = dict(stats() if callable(stats) else stats or {})
        origin_reads = got.get("client", {}).get("origin_reads", 0)
        if origin_reads:
            raise RuntimeError(f"the daemon could not place {origin_reads} shard(s) (served from origin): "
                               "raise --ram-budget; a 'hot' figure would be an origin figure")
        return got
    finally:
        close_source(source)


def evict_page_cache(root: str, index: ShardIndex) -> bool:
    """Drop the origin's shard files from the OS page cache (no root needed for
    clean pages), so a "cold" pass really reads the disk. False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for entry in index.shards:
        fd = os.open(str(Path(root) / entry.name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def zstd_limit(root: str, index: ShardIndex, *, min_seconds: float = 1.0, max_samples: int = 256) -> float:
    """Frames/s one core decompresses from the very frame payloads the loader
    reads, already in memory, into one reused buffer: no I/O, no parsing, no
    copies — the ceiling of a decode worker."""
    ds = index.dataset
    source = OriginSource(root, index)
    blobs: list[tuple[bytes, int]] = []
    for entry in index.shards:
        for off, length, k in zip(entry.offsets, entry.lengths, entry.frames):
            parts = SampleParts(source.read_range(entry.name, off, length))
            blobs.extend((bytes(parts.frames_blob(slot)), k) for slot in ds.slots)
            if len(blobs) >= max_samples * len(ds.slots):
                break
        if len(blobs) >= max_samples * len(ds.slots):
            break
    kmax = max(k for _, k in blobs)
    out = np.empty((kmax, ds.height * 3 // 2, ds.width), np.uint8)
    frames, start = 0, time.perf_counter()
    while True:
        for blob, k in blobs:
            decompress_into(blob, out[:k])
            frames += k
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return frames / elapsed


def cache_counters(root: str, index: ShardIndex, socket: str) -> dict:
    """The daemon's counters (hits, misses, fills per tier), to show the hot
    figures really were served from the RAM tier."""
    from loongforge.train.data.sources import SourceSpec, close_source, make_source

    source = make_source(SourceSpec(root=root, cache_socket=socket), index)
    try:
        stats = getattr(source, "stats", None)
        got = stats() if callable(stats) else {}
        return got.get("daemon", {}).get("counters", got)
    finally:
        close_source(source)


def shard_index_of(root: str, version: int) -> ShardIndex:
    """Shard names and bytes (what the daemon serves and the page cache holds) of either format."""
    if version == 2:
        from loongforge.shared.dataset_v2 import open_v2

        return open_v2(root).shard_index
    from loongforge.shared.index import load_index

    return load_index(root)


def zstd_limit_v2(root: str, *, min_seconds: float = 1.0, max_blocks: int = 256) -> float:
    """Format 2's ceiling: frames/s one core decompresses from the root's own frame blocks
    (every camera), bytes already in memory, into one reused buffer (`blocks.decode_block`,
    the codec the loader uses; no checksum, no I/O). The loader may pass it: a decoded block
    serves up to B/stride samples, so frames delivered can exceed frames decompressed."""
    from loongforge.shared.blocks import decode_block
    from loongforge.shared.dataset_v2 import open_v2

    ds = open_v2(root)
    blobs: list[tuple[bytes, int]] = []
    for e in range(ds.num_episodes):
        for b in range(ds.num_blocks(e)):
            for cam in ds.cameras:
                name, off, length, n, _ = ds.block_entry(e, cam, b)
                blobs.append((bytes(ds.source.read_range(name, off, length)), n))
        if len(blobs) >= max_blocks:
            break
    out = np.empty((ds.block_size, *ds.frame_shape(ds.cameras[0])), np.uint8)
    frames, start = 0, time.perf_counter()
    while True:
        for blob, n in blobs:
            decode_block(blob, out[:n], "zstd limit", ds.block_codec)
            frames += n
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return frames / elapsed
