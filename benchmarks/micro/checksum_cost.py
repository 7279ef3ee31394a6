"""What the checksums cost a decode worker, format 2 (per block) or format 1 (per sample).

    python -m loongforge.benchmarks.micro.checksum_cost SHARDS [--rounds 15]

Measured in CPU time (`time.thread_time`), so a busy shared machine changes
the figures less than it changes wall-clock rows. SHARDS' format decides:

- format 2 (what preprocess writes; the P2 bench root `loongforge bench --workdir
  DIR` keeps under DIR/shards_v2): every block read is xxh3-checked against the
  index before it is decompressed (`DatasetV2._decode`), then cached decoded. Over
  every block of every camera, bytes in RAM: xxh3 + `blocks.decode_block` against
  `decode_block` alone, interleaved; then xxh3_64 and zlib.crc32 alone against the
  decompression of the same blocks (the work P2's format-2 limit measures).
- format 1 (DIR/shards): the decode workers' body (`train.batch.fill_batch`) over
  the loader's epoch order with the index as written (every range read hashed and
  checked) and with the same index minus its checksums (what an older index gives),
  interleaved; then the hashes against zstd of the same samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import zlib

import numpy as np
import xxhash

from loongforge.shared.format import SampleParts, decompress_into
from loongforge.shared.index import load_index
from loongforge.shared.source import OriginSource
from loongforge.train.data.batch import BatchLayout, Norm, bucket_for, default_buckets, fill_batch
from loongforge.train.data.order_v1 import epoch_sequence


def _cpu(fn) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def worker_body(root: str, rounds: int, batch: int = 8) -> dict:
    index = load_index(root)
    bare = dataclasses.replace(index, shards=tuple(dataclasses.replace(s, xxh3=()) for s in index.shards))
    buckets = default_buckets(max(max(s.frames) for s in index.shards))
    layout = BatchLayout.from_index(index, batch, 32, buckets[-1])
    arrays = layout.views(bytearray(layout.nbytes), bucket_for(buckets[-1], buckets))
    norm, source = Norm.from_index(index), OriginSource(root, index)
    ids = epoch_sequence([s.samples for s in index.shards], 0, 0, 64)
    plans = [[(int(g), *index.locate(int(g))) for g in ids[i:i + batch]] for i in range(0, len(ids) - batch + 1, batch)]
    frames = sum(index.shards[s].frames[i] for items in plans for _, s, i in items) * len(layout.slots)

    def body(idx):
        return lambda: [fill_batch(source, idx, layout, norm, arrays, items, "raise") for items in plans]

    _cpu(body(index)), _cpu(body(bare))  # map the shards, warm the caches
    on, off = [], []
    for _ in range(rounds):
        on.append(_cpu(body(index)))
        off.append(_cpu(body(bare)))
    return {"frames": frames, "checked_frames_per_cpu_s": frames / statistics.median(on),
            "unchecked_frames_per_cpu_s": frames / statistics.median(off),
            "added_cpu": statistics.median(on) / statistics.median(off) - 1}


def hash_vs_zstd(root: str, rounds: int = 5) -> dict:
    index = load_index(root)
    source = OriginSource(root, index)
    ranges = [source.read_range(e.name, o, n) for e in index.shards for o, n in zip(e.offsets, e.lengths)]
    blobs = []
    for r in ranges:
        parts = SampleParts(r)
        blobs += [(parts.frames_blob(s), parts.meta["num_frames"]) for s in index.dataset.slots]
    ds = index.dataset
    out = np.empty((max(k for _, k in blobs), ds.height * 3 // 2, ds.width), np.uint8)
    zstd = statistics.median(_cpu(lambda: [decompress_into(b, out[:k]) for b, k in blobs]) for _ in range(rounds))
    xxh = statistics.median(_cpu(lambda: [xxhash.xxh3_64_hexdigest(r) for r in ranges]) for _ in range(rounds))
    crc = statistics.median(_cpu(lambda: [zlib.crc32(r) for r in ranges]) for _ in range(rounds))
    nbytes = sum(len(r) for r in ranges)
    return {"bytes": nbytes, "xxh3_gb_per_cpu_s": nbytes / xxh / 1e9, "crc32_gb_per_cpu_s": nbytes / crc / 1e9,
            "xxh3_over_zstd": xxh / zstd, "crc32_over_zstd": crc / zstd}


def block_checks(root: str, rounds: int) -> dict:
    """Format 2: xxh3 check + decompression per block against decompression alone, and the
    hashes alone against decompression, over every block of the root, bytes in RAM."""
    from loongforge.shared.blocks import decode_block
    from loongforge.shared.dataset_v2 import open_v2

    ds = open_v2(root)
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


def main(argv: list[str] | None = None) -> None:
    from loongforge.train.data.loader import root_format_version

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", help="shard root (the P2 bench roots: DIR/shards_v2 or DIR/shards)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if root_format_version(args.shards) == 2:
        r = block_checks(args.shards, args.rounds)
        print(f"format 2, {r['blocks']} blocks ({r['frames']} frames, {r['bytes'] / 1e6:.1f} MB): check + decode "
              f"{r['checked_frames_per_cpu_s']:,.0f} frames/CPU-s, decode alone "
              f"{r['unchecked_frames_per_cpu_s']:,.0f}: "
              f"the per-block xxh3 adds {r['added_cpu']:+.1%} CPU time; xxh3_64 {r['xxh3_gb_per_cpu_s']:.2f} GB/CPU-s "
              f"({r['xxh3_over_zstd']:.1%} of the blocks' decompression), zlib.crc32 "
              f"{r['crc32_gb_per_cpu_s']:.2f} GB/CPU-s ({r['crc32_over_zstd']:.1%})")
        return
    body, hashes = worker_body(args.shards, args.rounds), hash_vs_zstd(args.shards)
    print(f"worker body over {body['frames']} frames: checked {body['checked_frames_per_cpu_s']:,.0f} frames/CPU-s, "
          f"unchecked {body['unchecked_frames_per_cpu_s']:,.0f}: the checksum adds {body['added_cpu']:+.1%} CPU time")
    print(f"hashing {hashes['bytes'] / 1e6:.1f} MB of sample ranges: "
          f"xxh3_64 {hashes['xxh3_gb_per_cpu_s']:.2f} GB/CPU-s "
          f"({hashes['xxh3_over_zstd']:.1%} of their zstd decompression), zlib.crc32 "
          f"{hashes['crc32_gb_per_cpu_s']:.2f} GB/CPU-s ({hashes['crc32_over_zstd']:.1%})")


if __name__ == "__main__":
    main()
