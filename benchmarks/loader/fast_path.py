"""LoongForge's side of the comparison: the trainer's `BlockLoader` reading the shard root
through the cache daemon, and the physical limit of that path (raw zstd of the frame blocks).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.data import deltas_of
from loongforge.benchmarks.harness.dataset import block_loader, decode_block, open_root
from loongforge.shared.index import ShardIndex
from loongforge.shared.source import OriginSource


def make_loader(root: str, cfg: BenchConfig, *, workers: int, socket: str | None, rgb: bool = True):
    """The loader as the trainer builds it (global batch = batch_size, one rank): K frames per camera
    at video deltas -(K-1)..0, a sample every `stride` timesteps; block order and per-worker block
    cache at their defaults (what a user gets). rgb=True returns normalized float RGB, the same thing
    the baseline returns; rgb=False the NV12 a GPU trainer receives."""
    from loongforge.train.data.sources import SourceSpec

    return block_loader(root, batch_size=cfg.batch_size, num_workers=workers, seed=cfg.seed, deltas=deltas_of(cfg),
                        stride=cfg.stride, device="cpu", rgb=rgb, source=SourceSpec(root=root, cache_socket=socket))


@contextmanager
def opened(loader):
    try:
        yield loader
    finally:
        loader.close()


def shard_index_of(root: str) -> ShardIndex:
    """Shard names and bytes of the root: what the daemon serves and the page cache holds."""
    return open_root(root).shard_index


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


def zstd_limit(root: str, *, min_seconds: float = 1.0, max_blocks: int = 256) -> float:
    """The ceiling of a decode worker: frames/s one core decompresses from the root's own frame
    blocks (every camera), bytes already in memory, into one reused buffer (`blocks.decode_block`,
    the codec the loader uses; no checksum, no I/O). The loader may pass it: a decoded block
    serves up to B/stride samples, so frames delivered can exceed frames decompressed."""
    ds = open_root(root)
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
