"""Cache benchmark: `loongforge bench cache [--quick]` (also folded into `loongforge bench data`).

Three measurements, each next to a baseline timed in the same run:
  1. hit rate of plan-aware caching vs LRU, cache = 30% of the dataset, two
     epochs of the trainer's real sample order (the loader's epoch order at its
     defaults, over episodes packed into shards), replayed through the daemon's
     own policy module (cache/policy.py, no I/O);
  2. RAM-tier read bandwidth through CacheClient (pread of the tier file, whose
     sha256 the client checks on every new open, and read_shard hashes its copy
     again) vs a plain numpy memcpy of the same bytes, and that check alone;
  3. cold-miss latency through a real daemon vs reading origin directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness.dataset import EpochOrder, RootWriter, SampleTable, open_root, synthetic_dataset_info
from loongforge.cache.replay import replay
from loongforge.shared.index import ShardIndex
from loongforge.train.config import DataConfig
from loongforge.cache.client import CacheClient
from loongforge.shared.source import OriginSource

CACHE_FRACTION = 0.30
READY = "cache daemon ready on"


# -- 1. hit rate -------------------------------------------------------------
EPISODES_PER_SHARD = 4
BLOCK = 16


def order_defaults() -> dict:
    """The trainer's defaults of the sample order (DataConfig): run, window, stride."""
    got = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    return {"run": got["block_run"], "window": got["block_window"], "stride": got["sample_stride"]}


def node_access_sequence(lengths: np.ndarray, seed: int, epoch: int, global_batch: int) -> list[int]:
    """Shard numbers in the order one node's readers first ask the daemon for them. All ranks
    read the same global batches' shards at once, and a client keeps a shard open once it
    has it, so the daemon sees each shard once per epoch, in first-touch order. The order is
    the loader's (episodes in shards of EPISODES_PER_SHARD, the uneven tail dropped)."""
    d = order_defaults()
    table = SampleTable(lengths, stride=d["stride"])
    order = EpochOrder(table, BLOCK, seed, epoch, run=d["run"], window=d["window"])
    ids = order.ids(0, order.num_samples // global_batch * global_batch)
    episodes, _ = table.locate(ids)
    return list(dict.fromkeys((episodes // EPISODES_PER_SHARD).tolist()))


def hit_rate_rows(quick: bool) -> list[dict]:
    n = 120 if quick else 400  # shards
    lengths = np.random.default_rng(0).integers(150, 601, n * EPISODES_PER_SHARD)  # GR00T-like episodes
    frames = lengths.reshape(n, EPISODES_PER_SHARD).sum(axis=1)
    sizes = {f"s{i}": int(frames[i]) * 10_000 for i in range(n)}  # bytes proportional to frames
    capacity = int(CACHE_FRACTION * sum(sizes.values()))
    batch, epochs = 16, []
    for e in range(2):
        epochs.append({0: [f"s{i}" for i in node_access_sequence(lengths, seed=0, epoch=e, global_batch=batch)]})
    w = 4
    # shards that ANNOUNCE_BATCHES=8 global batches span, counted on the order itself
    d = order_defaults()
    table = SampleTable(lengths, stride=d["stride"])
    first = EpochOrder(table, BLOCK, 0, 0, run=d["run"], window=d["window"]).ids(0, 8 * batch)
    horizon = len(np.unique(table.locate(first)[0] // EPISODES_PER_SHARD)) + 2
    cases = [
        ("LRU, fill on miss (baseline: Mosaic/fsspec style)", dict(plan_aware=False)),
        ("LRU + prefetch next 4", dict(plan_aware=False, window=w, fills_per_step=1)),
        ("plan-aware, rolling plan (8 batches ahead) + prefetch 4", dict(plan_aware=True, window=w, fills_per_step=1,
                                                                          horizon=horizon)),
        ("plan-aware, both epochs announced, no prefetch (Belady only)", dict(plan_aware=True)),
        ("plan-aware, both epochs announced + prefetch 4 (LoongForge)", dict(plan_aware=True, window=w,
                                                                             fills_per_step=1)),
        ("LRU + prefetch 4, origin at 0.6 fills/read", dict(plan_aware=False, window=w, fills_per_step=0.6)),
        ("plan-aware + prefetch 4, origin at 0.6 fills/read", dict(plan_aware=True, window=w, fills_per_step=0.6)),
    ]
    rows = []
    base = None
    for i, (title, kw) in enumerate(cases):
        r = replay(epochs, sizes, capacity, name=title, **kw)
        base = base or r
        rows.append({"id": f"hit-{i}", "title": title, "metric": "hit rate", "epoch1": round(r.hit_rate(0), 4),
                     "epoch2": round(r.hit_rate(1), 4), "vs_lru_epoch2": _ratio(r.hit_rate(1), base.hit_rate(1)),
                     "origin_fills": r.origin_fills, "reads": sum(r.reads), "shards": n,
                     "cache_fraction": CACHE_FRACTION, "order": f"the loader's epoch order ({d})"})
    return rows


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


# -- helpers for the I/O measurements -----------------------------------------
def make_random_root(root: str, shards: int, shard_bytes: int) -> ShardIndex:
    """A shard root of incompressible frames (like encoded video), one episode per shard: the
    daemon moves and hashes bytes, it never parses them. Returns its shard-level index."""
    side = 256
    frames = max(1, shard_bytes // (side * side * 3 // 2))
    rng = np.random.default_rng(1)
    info = synthetic_dataset_info(side, side, ("front",), 4, 4)
    with RootWriter(root, info, shard_size=shard_bytes // 2, created_by="benchmarks/loader/cache.py") as w:
        arrays = {"state": np.zeros((frames, 4), np.float32), "action": np.zeros((frames, 4), np.float32),
                  "timestamp": np.arange(frames) / 20.0, "frame_index": np.arange(frames, dtype=np.int64),
                  "task_index": np.zeros(frames, np.int64)}
        for e in range(shards):  # a shard holds one episode: the writer cuts after each that passes shard_size/2
            w.add_episode(e, {"front": rng.integers(0, 256, (frames, side * 3 // 2, side), np.uint8)}, arrays)
    return open_root(root).shard_index


class _Daemon:
    def __init__(self, origin: str, work: Path, ram_budget: str, ram_base: str = "/dev/shm"):
        self.work = work
        self.socket = str(work / "c.sock")
        shm = Path(ram_base) if os.access(ram_base, os.W_OK) else work
        self.ram = shm / f"lf-cache-bench-{os.getpid()}"
        self.args = [sys.executable, "-m", "loongforge.cache", "serve", "--origin", origin, "--socket", self.socket,
                     "--ram-dir", str(self.ram), "--ram-budget", ram_budget, "--ssd-dir", str(work / "ssd"),
                     "--ssd-budget", "8GiB", "--prefetch-window", "0"]

    def __enter__(self):
        self.log = open(self.work / "daemon.log", "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if READY in (self.work / "daemon.log").read_text():
                return self
            time.sleep(0.05)
        raise RuntimeError("cache daemon did not start: " + (self.work / "daemon.log").read_text()[-2000:])

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.ram, ignore_errors=True)
        shutil.rmtree(self.work / "ssd", ignore_errors=True)


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- 2. RAM-tier read bandwidth ------------------------------------------------
def _tmpfs_pages(path: str) -> str:
    """'huge=...' option of the tmpfs holding `path`, from /proc/mounts."""
    best, opts = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype, options = line.split()[:4]
            if path.startswith(mnt) and len(mnt) > len(best):
                best = mnt
                opts = next((o for o in options.split(",") if o.startswith("huge=")), f"{fstype}, 4 KiB pages")
    return opts


def ram_bandwidth_rows(root: str, index: ShardIndex, work: Path, repeats: int, ram_base: str = "/dev/shm",
                       tag: str = "") -> list[dict]:
    names = [s.name for s in index.shards]
    total = sum(s.bytes for s in index.shards)
    dst = np.empty(max(s.bytes for s in index.shards), np.uint8)
    dst.fill(0)  # fault the destination in once, for both sides
    with _Daemon(root, work, ram_budget=f"{2 * total // 2**20 + 64}MiB", ram_base=ram_base) as d:
        with CacheClient(root, index, socket_path=d.socket) as warm:
            for n in names:
                warm.read_shard(n)  # fill the RAM tier
        # numpy-allocated (huge pages where the kernel allows): the fastest memcpy source this box has.
        in_memory = [np.frombuffer(Path(root, n).read_bytes(), np.uint8).copy() for n in names]
        cold, hot, memcpy, hashing = [], [], [], []
        for _ in range(repeats):  # interleaved, best of N: a busy machine hits both sides alike
            t0 = time.perf_counter()
            for src in in_memory:
                np.copyto(dst[:len(src)], src)
            memcpy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for src in in_memory:  # what the client adds to every new open: its sha256 check against the index
                hashlib.sha256(src).digest()
            hashing.append(time.perf_counter() - t0)
            with CacheClient(root, index, socket_path=d.socket) as client:
                t0 = time.perf_counter()
                for n in names:  # request + open + sha256 of the tier file + pread copy, hashed + read every byte
                    src = np.frombuffer(client.read_shard(n), np.uint8)
                    np.copyto(dst[:len(src)], src)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for n in names:  # already open: pread copy, hashed, + read every byte
                    src = np.frombuffer(client.read_shard(n), np.uint8)
                    np.copyto(dst[:len(src)], src)
                hot.append(time.perf_counter() - t0)
                del src
    base = total / min(memcpy) / 1e9
    rows = []
    where = f" [{ram_base}: {_tmpfs_pages(ram_base)}]"
    for i, (title, times) in enumerate([("numpy memcpy of the same bytes (baseline)", memcpy),
                                        ("CacheClient.read_shard + read, first open (file and copy sha256 checked)" + where, cold),
                                        ("CacheClient.read_shard + read, already open (copy sha256 checked)" + where, hot),
                                        ("sha256 of the same bytes alone: the client's check of a new open", hashing)]):
        gbps = total / min(times) / 1e9
        rows.append({"id": f"ram-read{tag}-{i}", "title": title, "metric": "GB/s", "value": round(gbps, 2),
                     "vs_memcpy": round(gbps / base, 2), "bytes": total, "repeats": repeats, "ram_dir": ram_base})
    return rows


# -- 3. cold-miss latency ----------------------------------------------------------
def cold_miss_rows(root: str, index: ShardIndex, work: Path) -> list[dict]:
    names = [s.name for s in index.shards]
    size = index.shards[0].bytes
    direct, through = [], []
    for n in names:
        _drop_page_cache(os.path.join(root, n))
        t0 = time.perf_counter()
        view = OriginSource(root, index).read_shard(n)  # mmap + sha256, what the client falls back to
        direct.append(time.perf_counter() - t0)
        del view
    with _Daemon(root, work, ram_budget=f"{2 * index.total_bytes // 2**20 + 64}MiB") as d:
        with CacheClient(root, index, socket_path=d.socket, timeout=60.0) as client:
            client.stats()  # connect outside the timed region
            for n in names:
                _drop_page_cache(os.path.join(root, n))
                t0 = time.perf_counter()
                client.read_shard(n)  # origin read + verify + RAM/SSD write + pread copy, hashed
                through.append(time.perf_counter() - t0)
            assert client.counts["origin_reads"] == 0, "client fell back to origin: daemon not serving"
    rows = []
    for i, (title, times) in enumerate([("origin read + verify, no cache (baseline)", direct),
                                        ("cold miss through the daemon (fill RAM+SSD, read)", through)]):
        med = float(np.median(times))
        rows.append({"id": f"cold-miss-{i}", "title": title, "metric": "ms per shard", "value": round(med * 1e3, 2),
                     "MB/s": round(size / med / 1e6, 1), "vs_origin": round(med / float(np.median(direct)), 2),
                     "shard_bytes": size, "shards": len(names)})
    return rows


def run(quick: bool, ram_dirs: tuple[str, ...] = ()) -> list[dict]:
    """Rows for `loongforge bench`. `ram_dirs`: extra RAM-tier bases to measure,
    e.g. a tmpfs mounted with huge=within_size (see infra/cache/README)."""
    rows = hit_rate_rows(quick)
    shards, shard_mib, repeats = (4, 16, 3) if quick else (8, 64, 7)
    with tempfile.TemporaryDirectory(prefix="lf-cache-bench-") as tmp:
        work = Path(tmp)
        root = str(work / "origin")
        index = make_random_root(root, shards, shard_mib << 20)
        rows += ram_bandwidth_rows(root, index, work, repeats)
        for i, extra in enumerate(ram_dirs):
            rows += ram_bandwidth_rows(root, index, work, repeats, ram_base=extra, tag=f"-{i + 1}")
        rows += cold_miss_rows(root, index, work)
    return rows


def render(rows: list[dict]) -> str:
    lines = []
    hit = [r for r in rows if r["metric"] == "hit rate"]
    if hit:
        lines += [f"Hit rate, cache = {CACHE_FRACTION:.0%} of {hit[0]['shards']} shards, 2 epochs "
                  f"(order: {hit[0]['order']})", "",
                  f"| {'policy':<62} | epoch 1 | epoch 2 | epoch 2 vs LRU | origin fills |", "|" + "-" * 64 +
                  "|---------|---------|----------------|--------------|"]
        lines += [f"| {r['title']:<62} | {r['epoch1']:>7.1%} | {r['epoch2']:>7.1%} | "
                  f"{(str(r['vs_lru_epoch2']) + 'x') if r['vs_lru_epoch2'] else '-':>14} | {r['origin_fills']:>12} |"
                  for r in hit]
    for metric, key, ratio in (("GB/s", "value", "vs_memcpy"), ("ms per shard", "value", "vs_origin")):
        sel = [r for r in rows if r["metric"] == metric]
        if sel:
            width = max(52, *(len(r["title"]) for r in sel))
            lines += ["", f"| {'measurement':<{width}} | {metric:>12} | {ratio:>9} |",
                      "|" + "-" * (width + 2) + "|" + "-" * 14 + "|" + "-" * 11 + "|"]
            lines += [f"| {r['title']:<{width}} | {r[key]:>12} | {r[ratio]:>9} |" for r in sel]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller trace and shards (~20 s)")
    p.add_argument("--ram-dir", action="append", default=[],
                   help="also measure a RAM tier under this directory (e.g. a huge=within_size tmpfs)")


def handle(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    rows = run(args.quick, tuple(args.ram_dir))
    print(render(rows))
    print(f"\n({time.perf_counter() - t0:.1f}s, {os.cpu_count()} CPUs)")
    return 0
