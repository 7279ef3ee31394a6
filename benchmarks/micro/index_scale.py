"""Index scale: what opening the index and looking samples up costs a process,
format 2 (memory-mapped tables) against format 1 (index.json), same run.

    python -m loongforge.benchmarks.micro.index_scale                      # v2 at 100 M samples, v1 at 1 M
    python -m loongforge.benchmarks.micro.index_scale --v2-samples 1e6 --v1-samples 1e5   # quick

Builds synthetic indexes only (no frame bytes: lookups never touch shards):
GR00T-shaped, every timestep a sample, episodes of 300-700 frames, one
camera, blocks of `--block-frames`. Each figure comes from a fresh process
(`python -c`), as a decode worker would start: open time, RSS after open and
after the lookups (psutil; `shared` = file-backed resident pages, i.e. the
page cache every process on the node shares; `private` = rss - shared), and
the CPU cost (thread time, best of 3) of one lookup (`locate`; v2 also
`block_entry`) over random sample numbers, the empty loop subtracted. v1 is measured at a size it can handle
and extrapolated linearly in samples (its open parses and its RSS holds every
sample's entry). Prints a markdown table, writes
results/index-scale-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.shared import paths, storage
from loongforge.shared.index_v2 import bucket_shift, frame_buckets, manifest_json
from loongforge.shared.synthetic_v2 import synthetic_dataset_info
from loongforge.shared.writer_v2 import write_tables

EPISODES_PER_SHARD = 100
TARGETS = {"open_s": 1.0, "rss_mb": 100.0, "locate_us": 2.0}


def _lengths(samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(300, 701, size=samples // 300 + 1)
    cut = int(np.searchsorted(np.cumsum(lengths), samples))
    lengths = lengths[: cut + 1].astype(np.int64)
    lengths[-1] -= int(lengths.sum()) - samples  # exactly `samples` frames
    return lengths[lengths > 0]


def build_v2_index(root: str, samples: int, block: int) -> dict:
    """Tables + manifest of a `samples`-frame, one-camera v2 root, vectorised (no shard bytes)."""
    lengths = _lengths(samples)
    e = len(lengths)
    start = np.zeros(e + 1, np.int64)
    np.cumsum(lengths, out=start[1:])
    nblocks = -(-lengths // block)
    first = np.zeros(e, np.int64)
    np.cumsum(nblocks[:-1], out=first[1:])
    nb = int(nblocks.sum())
    shard = (np.arange(e) // EPISODES_PER_SHARD).astype(np.int32)
    rng = np.random.default_rng(1)
    blocks = np.empty((nb, 4), np.uint64)
    blocks[:, 0] = np.arange(nb, dtype=np.uint64) * 40_000  # plausible offsets/lengths; never read
    blocks[:, 1] = 39_000
    blocks[:, 2] = block
    blocks[:, 3] = rng.integers(0, 2**63, nb, dtype=np.uint64)
    shift = bucket_shift(lengths)
    tables = {"episode_id": np.arange(e, dtype=np.int64), "episode_shard": shard, "episode_length": lengths,
              "episode_start": start, "episode_arrays": np.zeros((e, 3), np.uint64),
              "first_block": first.reshape(e, 1), "blocks": blocks, "frame_bucket": frame_buckets(start, shift)}
    entries = write_tables(root, tables)
    nshards = int(shard[-1]) + 1
    shards = [{"name": paths.shard_name(i), "bytes": 1 << 30, "sha256": "0" * 64} for i in range(nshards)]
    info = synthetic_dataset_info(256, 256, ("ego_view",), 44, 44)
    storage.write_bytes_atomic(paths.join(root, paths.INDEX_FILE), manifest_json(
        dataset=info, params={"block_size": block, "synthetic": True}, shards=shards, tables=entries, episodes=e,
        frames=samples, blocks=nb, bucket_shift=shift, created_by="benchmarks.index_scale"))
    return {"episodes": e, "blocks": nb, "shards": nshards,
            "table_bytes": sum(t["bytes"] for t in entries.values())}


def build_v1_index(root: str, samples: int) -> dict:
    """index.json of a v1 root with `samples` one-frame samples (what K=1 stride 1 writes), JSON made directly."""
    lengths = _lengths(samples)
    per_shard = 500
    shards, ep, t = [], 0, 0
    for s in range(-(-samples // per_shard)):
        n = min(per_shard, samples - s * per_shard)
        keys = []
        for _ in range(n):
            keys.append(f"e{ep:06d}_f{t:06d}")
            t += 1
            if t == lengths[ep]:
                ep, t = ep + 1, 0
        size = 7168
        shards.append({"name": paths.shard_name(s), "bytes": n * size + 1024, "sha256": "0" * 64, "keys": keys,
                       "offsets": list(range(0, n * size, size)), "lengths": [size] * n, "frames": [1] * n})
    from dataclasses import asdict

    info = synthetic_dataset_info(256, 256, ("ego_view",), 44, 44)
    doc = {"format": "loongforge-shards", "format_version": 1, "created_by": "benchmarks.index_scale",
           "episodes": len(lengths), "dataset": asdict(info), "params": {}, "shards": shards, "failed": []}
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    storage.write_bytes_atomic(paths.join(root, paths.INDEX_FILE), data)
    return {"episodes": len(lengths), "shards": len(shards), "index_bytes": len(data)}


_PROBE = r"""
import json, sys, time, random
import psutil
from loongforge.shared.index import load_index
from loongforge.shared.dataset_v2 import open_v2
proc = psutil.Process()
def mem():
    m = proc.memory_info()
    return {"rss_mb": m.rss / 2**20, "shared_mb": m.shared / 2**20, "private_mb": (m.rss - m.shared) / 2**20}
version, root, lookups = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = mem()
t0, c0 = time.perf_counter(), time.process_time()
ix = open_v2(root) if version == "2" else load_index(root)
open_s, open_cpu_s = time.perf_counter() - t0, time.process_time() - c0
after_open = mem()
n = ix.num_frames if version == "2" else ix.num_samples
rng = random.Random(0)
probe = [rng.randrange(n) for _ in range(lookups)]
pairs = [ix.locate(x) for x in probe] if version == "2" else []
blocks = [(e, ix.block_of(t)[0]) for e, t in pairs]
def timed(loop):
    best = float("inf")
    for _ in range(3):  # CPU time of this thread: a loaded machine's preemption is not lookup cost
        t = time.thread_time()
        loop()
        best = min(best, time.thread_time() - t)
    return best
def empty():
    for x in probe:
        pass
def locate(f=ix.locate):
    for x in probe:
        f(x)
before_lookups = mem()  # the probe lists are the benchmark's, not the index's
out = {"open_s": open_s, "open_cpu_s": open_cpu_s, "base": base, "after_open": after_open,
       "locate_us": (timed(locate) - timed(empty)) / lookups * 1e6}
if version == "2":
    def empty2():
        for e, b in blocks:
            pass
    def entry(f=ix.block_entry):
        for e, b in blocks:
            f(e, 0, b)
    out["block_entry_us"] = (timed(entry) - timed(empty2)) / lookups * 1e6
after = mem()
out["lookups_added"] = {k: after[k] - before_lookups[k] for k in after}
print(json.dumps(out))
"""


def probe(version: int, root: str, lookups: int) -> dict:
    res = subprocess.run([sys.executable, "-c", _PROBE, str(version), root, str(lookups)], capture_output=True,
                         text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"probe v{version} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["rss_open_mb"] = out["after_open"]["rss_mb"] - out["base"]["rss_mb"]  # what the index adds
    return out


def _row(label: str, samples: int, r: dict, scale: float = 1.0, measured: bool = True) -> dict:
    """One table row; scale > 1 extrapolates what grows with the sample count (open time, the RSS
    the index adds) linearly; lookup costs are kept as measured (a bisect grows with log n)."""
    return {"index": label, "samples": samples, "measured": measured, "open_s": r["open_s"] * scale,
            "open_cpu_s": r["open_cpu_s"] * scale,
            "rss_open_mb": r["rss_open_mb"] * scale,
            "rss_total_mb": r["after_open"]["rss_mb"] + r["rss_open_mb"] * (scale - 1),
            "lookups_rss_mb": r["lookups_added"]["rss_mb"], "lookups_private_mb": r["lookups_added"]["private_mb"],
            "locate_us": r["locate_us"], "block_entry_us": r.get("block_entry_us")}


def markdown(rows: list[dict]) -> str:
    head = ("| index | samples | open wall (s) | open CPU (s) | RSS added by open (MB) | process RSS after open (MB) | RSS added by "
            "the lookups (MB), private | locate (us) | block lookup (us) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        tag = "" if r["measured"] else " (extrapolated)"
        be = f"{r['block_entry_us']:.2f}" if r["block_entry_us"] is not None else "-"
        lines.append(f"| {r['index']}{tag} | {r['samples']:,} | {r['open_s']:.3f} | {r['open_cpu_s']:.3f} | {r['rss_open_mb']:.1f} | "
                     f"{r['rss_total_mb']:.0f} | {r['lookups_rss_mb']:.0f}, {r['lookups_private_mb']:.0f} | "
                     f"{r['locate_us']:.2f} | {be} |")
    return "\n".join(lines)


def run(v2_samples: int, v1_samples: int, block: int, lookups: int, workdir: str) -> dict:
    load_start = os.getloadavg()
    v2_root, v1_root = os.path.join(workdir, "v2"), os.path.join(workdir, "v1")
    t = time.perf_counter()
    v2_built = build_v2_index(v2_root, v2_samples, block)
    v1_built = build_v1_index(v1_root, v1_samples)
    build_s = time.perf_counter() - t
    r2, r1 = probe(2, v2_root, lookups), probe(1, v1_root, lookups)
    scale = v2_samples / v1_samples
    rows = [_row("v1 index.json", v1_samples, r1), _row("v1 index.json", v2_samples, r1, scale, measured=False),
            _row("v2 mmap tables", v2_samples, r2)]
    ok = {"open_s": rows[-1]["open_s"] < TARGETS["open_s"],  # wall clock, load included
          "rss_mb": rows[-1]["rss_total_mb"] < TARGETS["rss_mb"],
          "locate_us": rows[-1]["locate_us"] < TARGETS["locate_us"]}
    return {"benchmark": "index-scale", "rows": rows, "targets": TARGETS, "v2_meets": ok, "raw": {"v2": r2, "v1": r1},
            "built": {"v2": v2_built, "v1": v1_built, "build_s": build_s}, "block_frames": block,
            "lookups": lookups, "load_avg": load_start, "host": platform.node(), "python": sys.version.split()[0],
            "numpy": np.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loongforge.benchmarks.micro.index_scale", description=__doc__.splitlines()[0])
    p.add_argument("--v2-samples", type=float, default=100e6, help="samples (frames) of the v2 index (100e6)")
    p.add_argument("--v1-samples", type=float, default=1e6, help="samples of the v1 index, extrapolated (1e6)")
    p.add_argument("--block-frames", type=int, default=16)
    p.add_argument("--lookups", type=int, default=200_000)
    p.add_argument("--workdir", help="where to build the indexes (default: a temp dir, removed)")
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="index-scale-", dir=args.workdir) as work:
        doc = run(int(args.v2_samples), int(args.v1_samples), args.block_frames, args.lookups, work)
    doc["load_avg_end"] = os.getloadavg()
    print(markdown(doc["rows"]))
    print(f"\nv2 meets targets (open < 1 s, RSS < 100 MB, locate < 2 us): {doc['v2_meets']}; "
          f"load average {doc['load_avg'][0]:.2f} -> {doc['load_avg_end'][0]:.2f}")
    write_timestamped(args.out, "index-scale", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
