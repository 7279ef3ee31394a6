"""Index scale: what opening the index and looking samples up costs a process, the shard
root's memory-mapped tables against the same tables in one JSON document, same run.

    loongforge bench index-scale                                    # tables at 100 M samples, JSON at 1 M
    loongforge bench index-scale --samples 1e6 --json-samples 1e5  # quick

Builds synthetic indexes only (no frame bytes: lookups never touch shards): GR00T-shaped,
every timestep a sample, episodes of 300-700 frames, one camera, blocks of `--block-frames`.
The baseline holds exactly the tables the root holds (episode starts, first block, block
entries, episode shard), as JSON lists, opened with `json.load` and looked up with `bisect`:
what an index that is parsed rather than mapped costs (the loaders users run today keep
their metadata in JSON: LeRobot's meta/*.jsonl, Mosaic's index.json). Each figure comes from
a fresh process (`python -c`), as a decode worker would start: open time, RSS after open and
after the lookups (psutil; `shared` = file-backed resident pages, i.e. the page cache every
process on the node shares; `private` = rss - shared), and the CPU cost (thread time, best
of 3) of one lookup (`locate`, then `block_entry`) over random sample numbers, the empty loop
subtracted. The JSON index is measured at a size it can handle and extrapolated linearly in
samples (its open parses and its RSS holds every entry). Prints a markdown table, writes
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

from loongforge.benchmarks.harness.dataset import (bucket_shift, frame_buckets, manifest_json, synthetic_dataset_info,
                                                   write_tables)
from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.shared import paths, storage

EPISODES_PER_SHARD = 100
TARGETS = {"open_s": 1.0, "rss_mb": 100.0, "locate_us": 2.0}


def episode_lengths(samples: int, seed: int = 0) -> np.ndarray:
    """Episodes of 300-700 frames adding up to exactly `samples` frames."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(300, 701, size=samples // 300 + 1)
    cut = int(np.searchsorted(np.cumsum(lengths), samples))
    lengths = lengths[: cut + 1].astype(np.int64)
    lengths[-1] -= int(lengths.sum()) - samples  # exactly `samples` frames
    return lengths[lengths > 0]


def build_tables(samples: int, block: int) -> dict[str, np.ndarray]:
    """The tables of a `samples`-frame, one-camera shard root, vectorised (no shard bytes)."""
    lengths = episode_lengths(samples)
    e = len(lengths)
    start = np.zeros(e + 1, np.int64)
    np.cumsum(lengths, out=start[1:])
    nblocks = -(-lengths // block)
    first = np.zeros(e, np.int64)
    np.cumsum(nblocks[:-1], out=first[1:])
    nb = int(nblocks.sum())
    blocks = np.empty((nb, 4), np.uint64)
    blocks[:, 0] = np.arange(nb, dtype=np.uint64) * 40_000  # plausible offsets/lengths; never read
    blocks[:, 1] = 39_000
    blocks[:, 2] = block
    blocks[:, 3] = np.random.default_rng(1).integers(0, 2**63, nb, dtype=np.uint64)
    return {"episode_id": np.arange(e, dtype=np.int64), "episode_shard": (np.arange(e) // EPISODES_PER_SHARD)
            .astype(np.int32), "episode_length": lengths, "episode_start": start,
            "episode_arrays": np.zeros((e, 3), np.uint64), "first_block": first.reshape(e, 1), "blocks": blocks}


def _shards(tables: dict) -> list[dict]:
    count = int(tables["episode_shard"][-1]) + 1
    return [{"name": paths.shard_name(i), "bytes": 1 << 30, "sha256": "0" * 64} for i in range(count)]


def build_root_index(root: str, samples: int, block: int) -> dict:
    """Tables + manifest of the shard root (memory-mapped when opened)."""
    tables = build_tables(samples, block)
    shift = bucket_shift(tables["episode_length"])
    tables["frame_bucket"] = frame_buckets(tables["episode_start"], shift)
    entries = write_tables(root, tables)
    shards = _shards(tables)
    e, nb = len(tables["episode_length"]), len(tables["blocks"])
    info = synthetic_dataset_info(256, 256, ("ego_view",), 44, 44)
    storage.write_bytes_atomic(paths.join(root, paths.INDEX_FILE), manifest_json(
        dataset=info, params={"block_size": block, "synthetic": True}, shards=shards, tables=entries, episodes=e,
        frames=samples, blocks=nb, bucket_shift=shift, created_by="benchmarks.index_scale"))
    return {"episodes": e, "blocks": nb, "shards": len(shards),
            "table_bytes": sum(t["bytes"] for t in entries.values())}


def build_json_index(root: str, samples: int, block: int) -> dict:
    """The same tables as one JSON document (lists), what a parsed index holds."""
    tables = build_tables(samples, block)
    doc = {"block_size": block, "shards": _shards(tables),
           **{name: tables[name].reshape(len(tables[name]), -1).tolist() if tables[name].ndim > 1
              else tables[name].tolist() for name in ("episode_shard", "episode_start", "first_block", "blocks")}}
    data = json.dumps(doc, separators=(",", ":")).encode()
    storage.write_bytes_atomic(os.path.join(root, JSON_INDEX), data)
    return {"episodes": len(tables["episode_length"]), "blocks": len(tables["blocks"]), "index_bytes": len(data)}


JSON_INDEX = "index-tables.json"


_PROBE = r"""
import bisect, json, os, sys, time, random
import psutil
from loongforge.shared.dataset import open_root  # what a decode worker imports (no torch)
class JsonIndex:
    # the same tables, parsed: locate by bisect over the episode starts, block entries by list index
    def __init__(self, path):
        with open(path) as f:
            doc = json.load(f)
        self.starts, self.first, self.blocks = doc["episode_start"], doc["first_block"], doc["blocks"]
        self.shard, self.names = doc["episode_shard"], [s["name"] for s in doc["shards"]]
        self.block_size, self.num_frames = doc["block_size"], self.starts[-1]
    def locate(self, n):
        e = bisect.bisect_right(self.starts, n) - 1
        return e, n - self.starts[e]
    def block_of(self, t):
        return divmod(t, self.block_size)
    def block_entry(self, e, camera, b):
        off, length, n, digest = self.blocks[self.first[e][camera] + b]
        return self.names[self.shard[e]], off, length, n, digest
proc = psutil.Process()
def mem():
    m = proc.memory_info()
    return {"rss_mb": m.rss / 2**20, "shared_mb": m.shared / 2**20, "private_mb": (m.rss - m.shared) / 2**20}
kind, root, lookups = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = mem()
t0, c0 = time.perf_counter(), time.process_time()
ix = open_root(root) if kind == "tables" else JsonIndex(os.path.join(root, sys.argv[4]))
open_s, open_cpu_s = time.perf_counter() - t0, time.process_time() - c0
after_open = mem()
rng = random.Random(0)
probe = [rng.randrange(ix.num_frames) for _ in range(lookups)]
pairs = [ix.locate(x) for x in probe]
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
def empty2():
    for e, b in blocks:
        pass
def entry(f=ix.block_entry):
    for e, b in blocks:
        f(e, 0, b)
before_lookups = mem()  # the probe lists are the benchmark's, not the index's
out = {"open_s": open_s, "open_cpu_s": open_cpu_s, "base": base, "after_open": after_open,
       "locate_us": (timed(locate) - timed(empty)) / lookups * 1e6,
       "block_entry_us": (timed(entry) - timed(empty2)) / lookups * 1e6}
after = mem()
out["lookups_added"] = {k: after[k] - before_lookups[k] for k in after}
print(json.dumps(out))
"""


def probe(kind: str, root: str, lookups: int) -> dict:
    res = subprocess.run([sys.executable, "-c", _PROBE, kind, root, str(lookups), JSON_INDEX], capture_output=True,
                         text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"probe of the {kind} index failed:\n{res.stderr[-3000:]}")
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
        lines.append(f"| {r['index']}{tag} | {r['samples']:,} | {r['open_s']:.3f} | {r['open_cpu_s']:.3f} | "
                     f"{r['rss_open_mb']:.1f} | {r['rss_total_mb']:.0f} | {r['lookups_rss_mb']:.0f}, "
                     f"{r['lookups_private_mb']:.0f} | {r['locate_us']:.2f} | {r['block_entry_us']:.2f} |")
    return "\n".join(lines)


def run(samples: int, json_samples: int, block: int, lookups: int, workdir: str) -> dict:
    load_start = os.getloadavg()
    root, json_root = os.path.join(workdir, "root"), os.path.join(workdir, "json")
    os.makedirs(json_root)
    t = time.perf_counter()
    built = {"tables": build_root_index(root, samples, block), "json": build_json_index(json_root, json_samples, block)}
    built["build_s"] = time.perf_counter() - t
    tables, parsed = probe("tables", root, lookups), probe("json", json_root, lookups)
    rows = [_row("JSON tables (json.load)", json_samples, parsed),
            _row("JSON tables (json.load)", samples, parsed, samples / json_samples, measured=False),
            _row("mmap tables (shard root)", samples, tables)]
    ok = {"open_s": rows[-1]["open_s"] < TARGETS["open_s"],  # wall clock, load included
          "rss_mb": rows[-1]["rss_total_mb"] < TARGETS["rss_mb"],
          "locate_us": rows[-1]["locate_us"] < TARGETS["locate_us"]}
    return {"benchmark": "index-scale", "rows": rows, "targets": TARGETS, "meets": ok,
            "raw": {"tables": tables, "json": parsed}, "built": built, "block_frames": block, "lookups": lookups,
            "load_avg": load_start, "host": platform.node(), "python": sys.version.split()[0],
            "numpy": np.__version__}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=float, default=100e6, help="samples (frames) of the shard root's index (100e6)")
    p.add_argument("--json-samples", type=float, default=1e6, help="samples of the JSON index, measured there and "
                                                                    "extrapolated to --samples (1e6)")
    p.add_argument("--block-frames", type=int, default=16)
    p.add_argument("--lookups", type=int, default=200_000)
    p.add_argument("--workdir", help="where to build the indexes (default: a temp dir, removed)")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="index-scale-", dir=args.workdir) as work:
        doc = run(int(args.samples), int(args.json_samples), args.block_frames, args.lookups, work)
    doc["load_avg_end"] = os.getloadavg()
    print(markdown(doc["rows"]))
    print(f"\nmmap tables meet the targets (open < 1 s, RSS < 100 MB, locate < 2 us): {doc['meets']}; "
          f"load average {doc['load_avg'][0]:.2f} -> {doc['load_avg_end'][0]:.2f}")
    write_timestamped(args.out, "index-scale", doc)
    return 0
