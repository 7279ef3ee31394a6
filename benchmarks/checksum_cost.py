"""What the per-sample checksum (index key `sample_xxh3`) costs a decode worker.

    python -m loongforge.benchmarks.checksum_cost SHARDS [--rounds 15]

Measured in CPU time (`time.thread_time`), so a busy shared machine changes
the figures less than it changes wall-clock rows: the decode workers' body
(`train.batch.fill_batch`, what P2 times) over SHARDS in the loader's epoch
order, with the index as written (every range read hashed and checked) and
with the same index minus its checksums (what an older index gives),
interleaved; then xxh3_64 and zlib.crc32 alone against zstd decompression of
the same samples (the work P2's limit measures). Use the P2 bench shards
(`loongforge bench --workdir DIR` keeps them under DIR/shards).
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
from loongforge.train.batch import BatchLayout, Norm, bucket_for, default_buckets, fill_batch
from loongforge.train.order import epoch_sequence


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", help="shard root (the P2 bench shards)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    body, hashes = worker_body(args.shards, args.rounds), hash_vs_zstd(args.shards)
    print(f"worker body over {body['frames']} frames: checked {body['checked_frames_per_cpu_s']:,.0f} frames/CPU-s, "
          f"unchecked {body['unchecked_frames_per_cpu_s']:,.0f}: the checksum adds {body['added_cpu']:+.1%} CPU time")
    print(f"hashing {hashes['bytes'] / 1e6:.1f} MB of sample ranges: "
          f"xxh3_64 {hashes['xxh3_gb_per_cpu_s']:.2f} GB/CPU-s "
          f"({hashes['xxh3_over_zstd']:.1%} of their zstd decompression), zlib.crc32 "
          f"{hashes['crc32_gb_per_cpu_s']:.2f} GB/CPU-s ({hashes['crc32_over_zstd']:.1%})")


if __name__ == "__main__":
    main()
