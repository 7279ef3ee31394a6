"""What the checksums cost a decode worker: the per-block xxh3 check of a shard root.

    loongforge bench checksum-cost SHARDS [--rounds 15]

Measured in CPU time (`time.thread_time`), so a busy shared machine changes the figures less
than it changes wall-clock rows. Every block read is xxh3-checked against the index before it
is decompressed (the reader's `_decode`), then cached decoded. Over every block of every camera
of SHARDS (e.g. the data bench's root, `loongforge bench data --workdir DIR` keeps it under
DIR/shards), bytes in RAM: xxh3 + `decode_block` against `decode_block` alone, interleaved;
then xxh3_64 and zlib.crc32 alone against the decompression of the same blocks (the work P2's
limit measures).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

import numpy as np
import xxhash

from loongforge.benchmarks.harness.dataset import decode_block, open_root


def _cpu(fn) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def block_checks(root: str, rounds: int) -> dict:
    """xxh3 check + decompression per block against decompression alone, and the hashes alone
    against decompression, over every block of the root, bytes in RAM."""
    ds = open_root(root)
    blocks = []
    for e in range(ds.num_episodes):
        for b in range(ds.num_blocks(e)):
            for cam in ds.cameras:
                name, off, length, n, digest = ds.block_entry(e, cam, b)
                blocks.append((bytes(ds.source.read_range(name, off, length)), n, digest))
    out = np.empty((ds.block_size, *ds.frame_shape(ds.cameras[0])), np.uint8)

    def checked():
        for blob, n, digest in blocks:
            if xxhash.xxh3_64_intdigest(blob) != digest:
                raise AssertionError("block checksum mismatch: the root is corrupt")
            decode_block(blob, out[:n], "checksum_cost", ds.block_codec)

    def unchecked():
        for blob, n, _ in blocks:
            decode_block(blob, out[:n], "checksum_cost", ds.block_codec)

    _cpu(checked), _cpu(unchecked)  # warm the caches
    on, off = [], []
    for _ in range(rounds):
        on.append(_cpu(checked))
        off.append(_cpu(unchecked))
    raw = [b for b, _, _ in blocks]
    xxh = statistics.median(_cpu(lambda: [xxhash.xxh3_64_intdigest(r) for r in raw]) for _ in range(5))
    crc = statistics.median(_cpu(lambda: [zlib.crc32(r) for r in raw]) for _ in range(5))
    zstd = statistics.median(off)
    frames = sum(n for _, n, _ in blocks)
    nbytes = sum(len(r) for r in raw)
    return {"blocks": len(blocks), "frames": frames, "bytes": nbytes,
            "checked_frames_per_cpu_s": frames / statistics.median(on), "unchecked_frames_per_cpu_s": frames / zstd,
            "added_cpu": statistics.median(on) / zstd - 1, "xxh3_gb_per_cpu_s": nbytes / xxh / 1e9,
            "crc32_gb_per_cpu_s": nbytes / crc / 1e9, "xxh3_over_zstd": xxh / zstd, "crc32_over_zstd": crc / zstd}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", help="shard root (e.g. DIR/shards of `loongforge bench data --workdir DIR`)")
    p.add_argument("--rounds", type=int, default=15)


def handle(args: argparse.Namespace) -> int:
    r = block_checks(args.shards, args.rounds)
    print(f"{r['blocks']} blocks ({r['frames']} frames, {r['bytes'] / 1e6:.1f} MB): check + decode "
          f"{r['checked_frames_per_cpu_s']:,.0f} frames/CPU-s, decode alone {r['unchecked_frames_per_cpu_s']:,.0f}: "
          f"the per-block xxh3 adds {r['added_cpu']:+.1%} CPU time; xxh3_64 {r['xxh3_gb_per_cpu_s']:.2f} GB/CPU-s "
          f"({r['xxh3_over_zstd']:.1%} of the blocks' decompression), zlib.crc32 "
          f"{r['crc32_gb_per_cpu_s']:.2f} GB/CPU-s ({r['crc32_over_zstd']:.1%})")
    return 0
