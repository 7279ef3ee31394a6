"""Loader throughput with 0, 1 and 2 decode workers on a synthetic root.

    python -m loongforge.train.bench_loader [--size 128] [--frames 4] [--batches 60]

A quick sanity figure for the data path (shard read + zstd decode into shared
memory + NV12->RGB on the device). The real benchmarks live in benchmarks/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def measure(root: str, index, *, workers: int, batch: int, batches: int, rgb: bool) -> float:
    from loongforge.train.loader import ShardLoader

    with ShardLoader(root, batch_size=batch, num_workers=workers, index=index, max_steps=batches + 5,
                     rgb=rgb) as loader:
        it = iter(loader)
        for _ in range(5):  # warm-up: worker start, first buffers
            next(it)
        t0 = time.perf_counter()
        n = 0
        for b in it:
            n += b["sample_ids"].numel()
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128, help="frame height = width")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is printed")
    ap.add_argument("--root", help="measure this shard root instead of a synthetic one (e.g. preprocess output)")
    args = ap.parse_args()
    from loongforge.shared.index import load_index
    from loongforge.shared.synthetic import make_synthetic_root

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or tmp
        index = load_index(root) if args.root else make_synthetic_root(
            root, shards=8, samples_per_shard=32, frames=args.frames, height=args.size, width=args.size)
        ds, mb = index.dataset, index.total_bytes / 2**20
        print(f"{'root ' + root if args.root else 'synthetic root'}: {index.num_samples} samples, {len(ds.cameras)} "
              f"cameras x {ds.frames_per_sample} frames x {ds.height}x{ds.width} NV12, {mb:.1f} MiB of shards; "
              f"batch {args.batch}, {args.batches} batches")
        print(f"{'workers':>8} {'nv12 samples/s':>15} {'rgb samples/s':>14}")
        for w in (int(x) for x in args.workers.split(",")):
            cells = []
            for rgb in (False, True):
                runs = [measure(root, index, workers=w, batch=args.batch, batches=args.batches, rgb=rgb)
                        for _ in range(args.repeat)]
                cells.append(statistics.median(runs))
            print(f"{w:>8} {cells[0]:>15.1f} {cells[1]:>14.1f}")


if __name__ == "__main__":
    main()
