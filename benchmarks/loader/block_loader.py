"""The loader's worker body on GR00T-shaped data: samples/s per decode worker, NV12 out
(256x256 H.264 at 20 fps, 44-D state/action, one camera; K=1, H=16, every timestep a sample):

    B in {4, 8, 16, 32}   the worker body (the block filler) over BlockLoader's order, at run 4 with a
                          worker's 256 MiB LRU, at run 4 and run 1 with only the reuse inside a batch
                          (the fleet case); run 1 is a uniform random order, what GR00T's sampler does
    zstd limit            zstd decompression of B=16 blocks from RAM, frames/s = samples/s at K=1

and the order table: batch diversity of the block order against a uniform random permutation (the
order users run today), and the block decodes per sample a worker's LRU leaves (simulated for rank
0 of 8, worker 0 of 4); and what locating a sample costs at fleet scale; and the output table: the
whole loader (BlockLoader, CPU) at 0/1/2 workers, NV12 and float RGB out, with and without recycled
output buffers (HostPool), samples/s and samples per CPU-second of the process tree.

    loongforge bench block-loader --episodes 8      # ~12 min on a loaded 2-core VM
    loongforge bench block-loader --tables output   # the output A/B alone (B=16 root), ~3 min

Every figure of one run is measured in that run on the same frames, one process, one core;
report the ratios with the load average beside them. Writes results/block-loader-<time>-<host>.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import OrderedDict

import numpy as np

from loongforge.benchmarks.harness.cores import CpuMeter
from loongforge.benchmarks.harness.dataset import (BlockFiller, DeltaSpec, RootWriter, SampleTable, batch_diversity,
                                                   block_loader, block_sequence, decode_block, open_root, rank_slice)
from loongforge.benchmarks.harness.measure import time_pass
from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.shared.index import CameraInfo, DatasetInfo
from loongforge.train.data.batch import BatchLayout
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.samples.dataset import DATA_PATH, VIDEO_PATH, generate_dataset

CAM = "ego_view"
HORIZON = 16


def gr00t_episodes(workdir: str, episodes: int, seed: int = 0) -> list[tuple[np.ndarray, dict]]:
    """[(NV12 (T, 384, 256), arrays)] decoded from a generated GR00T-like LeRobot dataset."""
    import pyarrow.parquet as pq


    root = generate_dataset(os.path.join(workdir, "lerobot"), episodes=episodes, frames=(150, 300), height=256,
                            width=256, fps=20, cameras=(CAM,), state_dim=44, action_dim=44, gop=20, seed=seed)
    out = []
    for ep in range(episodes):
        table = pq.read_table(root / DATA_PATH.format(episode_chunk=0, episode_index=ep)).to_pydict()
        n = len(table["timestamp"])
        nv12, _ = decode_nv12(str(root / VIDEO_PATH.format(episode_chunk=0, video_key=f"observation.images.{CAM}",
                                                           episode_index=ep)), n)
        arrays = {"state": np.asarray(table["observation.state"], np.float32),
                  "action": np.asarray(table["action"], np.float32),
                  "timestamp": np.asarray(table["timestamp"], np.float64),
                  "frame_index": np.arange(n, dtype=np.int64), "task_index": np.asarray(table["task_index"], np.int64)}
        out.append((nv12, arrays))
    return out


def dataset_info() -> DatasetInfo:
    return DatasetInfo(fps=20.0, height=256, width=256, cameras=(CameraInfo(key=f"observation.images.{CAM}", slot=CAM,
                                                                            source_height=256, source_width=256),),
                       state_dim=44, action_dim=44, action_horizon=HORIZON, frames_per_sample=1,
                       tasks={"0": "pick", "1": "place"})


def write_root(root: str, episodes, block: int) -> None:
    with RootWriter(root, dataset_info(), block_size=block, shard_size=256 << 20) as w:
        for e, (nv12, arrays) in enumerate(episodes):
            w.add_episode(e, {CAM: nv12}, arrays)


def _timed(batches, fill) -> tuple[float, float, int]:
    fill(batches[0])  # open/map first: a worker does that once
    n, w0, c0 = 0, time.perf_counter(), time.process_time()
    for items in batches:
        fill(items)
        n += len(items)
    return n / (time.perf_counter() - w0), (time.process_time() - c0) / n * 1e6, n


def worker_row(root: str, batch: int, max_batches: int, run: int, window: int, cache_blocks: int | None = None):
    """The worker body over rank 0's batches (world 1). cache_blocks=None: the default 256 MiB LRU;
    a small number (2) leaves only the reuse inside a batch, what a worker sees when it gets 1/32
    or less of the batches (8 ranks x 4 workers): the fleet case."""
    ds = open_root(root)
    spec = DeltaSpec(video=(0,), action_horizon=HORIZON)
    table = SampleTable(np.asarray(ds.episode_lengths))
    seq = block_sequence(table.block_groups(ds.block_size), 0, 0, run=run, window=window)
    mine = [rank_slice(seq, c * batch, batch, 0, 1) for c in range(len(seq) // batch)]  # the tail is dropped
    batches = [list(zip(ids.tolist(), *(a.tolist() for a in table.locate(ids)))) for ids in mine][:max_batches]
    layout = BatchLayout(batch, (CAM,), 256, 256, 1, 44, 44, HORIZON, 32)
    arrays = layout.views(bytearray(layout.nbytes))
    budget = 256 << 20 if cache_blocks is None else cache_blocks * ds.block_size * 256 * 384
    filler = BlockFiller(ds, spec, layout, budget)
    rate, cpu_us, n = _timed(batches, lambda items: filler.fill(_rows(arrays, len(items)), items, "raise"))
    c = filler.cache.counters()
    return {"samples_per_s": rate, "cpu_us_per_sample": cpu_us, "samples": n,
            "block_decodes_per_sample": c["misses"] / max(1, c["hits"] + c["misses"])}


def _rows(arrays, n):
    return {k: v[:n] for k, v in arrays.items()}


def zstd_limit(root: str) -> dict:
    """Decompress every block of a B=16 root from RAM (bytes read first): the ceiling."""
    ds = open_root(root)
    blobs = []
    for e in range(ds.num_episodes):
        for b in range(ds.num_blocks(e)):
            name, off, length, n, _ = ds.block_entry(e, CAM, b)
            blobs.append((bytes(ds.source.read_range(name, off, length)), n))
    out = np.empty((ds.block_size, 384, 256), np.uint8)
    t0, frames = time.perf_counter(), 0
    for blob, n in blobs:
        decode_block(blob, out[:n], "zstd limit", ds.block_codec)
        frames += n
    return {"frames_per_s": frames / (time.perf_counter() - t0), "frames": frames}


def order_table(batch: int = 512, world: int = 8, workers: int = 4, episodes: int = 2000, block: int = 16,
                cache_blocks: int = 170, seed: int = 0) -> list[dict]:
    """Diversity and simulated decodes per sample of each order on GR00T-scale episode counts
    (lengths 150-600, every timestep a sample). cache_blocks: 256 MiB of 256x256 B=16 blocks."""
    table = SampleTable(np.random.default_rng(seed).integers(150, 600, episodes))
    groups = table.block_groups(block)
    ep, t = table.locate(np.arange(table.num_samples))
    orders = {"random permutation": (np.random.default_rng(seed).permutation(table.num_samples), None)}
    for run, window in ((1, 4096), (1, 1 << 30), (2, 65536), (4, 4096), (4, 65536), (8, 65536), (16, 65536)):
        orders[f"run={run} window={window}"] = (block_sequence(groups, seed, 0, run=run, window=window), run)
    rows = []
    for name, (seq, run) in orders.items():
        d = batch_diversity(seq, ep, t, groups, batch, max_batches=40)
        d.update(order=name, decodes_per_sample=_sim_decodes(seq, groups, batch, world, workers, cache_blocks,
                                                             contiguous=run is not None))
        rows.append(d)
    return rows


def _sim_decodes(seq, groups, batch, world, workers, cache_blocks, contiguous, batches=400) -> float:
    """Block decodes per sample of rank 0's worker 0 (LRU of cache_blocks), over `batches` global batches."""
    lru: OrderedDict = OrderedDict()
    misses = n = 0
    per = batch // world
    for b in range(0, min(batches, len(seq) // batch), workers):
        g = seq[b * batch:(b + 1) * batch]
        mine = g[:per] if contiguous else g[::world]  # the plain permutation: position p to rank p % world
        for blk in groups[mine].tolist():
            n += 1
            if blk in lru:
                lru.move_to_end(blk)
                continue
            misses += 1
            lru[blk] = True
            if len(lru) > cache_blocks:
                lru.popitem(last=False)
    return misses / max(1, n)


def locate_cost(episodes: int = 1_000_000, samples: int = 200_000) -> dict:
    """SampleTable.locate at fleet scale (1 M episodes of 150-600 frames: ~375 M samples):
    one id per call and batches of 64 ids (what a rank's batch plan does); CPU seconds, and
    np.searchsorted alone beside it (the floor: ~20 cache misses into an 8 MB column)."""
    table = SampleTable(np.random.default_rng(0).integers(150, 600, episodes))
    ids = np.random.default_rng(1).integers(0, table.num_samples, samples)
    t0 = time.process_time()
    for i in ids[:20000].tolist():
        table.locate(i)
    one = (time.process_time() - t0) / 20000
    t0 = time.process_time()
    for k in range(0, samples, 64):
        table.locate(ids[k:k + 64])
    batch64 = (time.process_time() - t0) / samples
    t0 = time.process_time()
    for k in range(0, samples, 64):
        np.searchsorted(table.ends, ids[k:k + 64], side="right")
    raw = (time.process_time() - t0) / samples
    return {"searchsorted_us_per_id": raw * 1e6, "episodes": episodes, "samples": table.num_samples,
            "us_per_call_scalar": one * 1e6,
            "us_per_id_batch64": batch64 * 1e6, "table_bytes": table.ends.nbytes + table.starts.nbytes}


def output_row(root: str, batch: int, batches: int, workers: int, rgb: bool, recycle: bool) -> dict:
    """The whole loader on CPU (rank 0 of 1, K=1, H=16, default order and cache): NV12 or float RGB out,
    recycled output buffers or a fresh one per batch; timed once every worker is up (`wait_ready`)."""
    loader = block_loader(root, batch_size=batch, num_workers=workers, rgb=rgb, recycle_buffers=recycle,
                          deltas=DeltaSpec(video=(0,), action_horizon=HORIZON))
    try:
        p = time_pass(iter(loader), warmup=1, timed=batches, meter=CpuMeter(), ready=loader.wait_ready)
    finally:
        loader.close()
    return {"samples_per_s": p.samples_per_s, "samples_per_cpu_s": p.samples_per_cpu_s}


CONFIGS = [(f"B={b} {name}", b, run, cache) for b in (4, 8, 16, 32)
           for name, run, cache in (("run=4, 1 worker (256 MiB LRU)", 4, None),
                                    ("run=4, fleet (reuse within batch)", 4, 2), ("run=1, fleet (random order)", 1, 2))]
TABLES = ("body", "order", "output")


def output_configs(workers: tuple[int, ...]) -> list[tuple[str, int, bool, bool]]:
    return [(f"W={w} {'float RGB' if rgb else 'NV12'} {'recycled' if recycle else 'fresh'}", w, rgb, recycle)
            for w in workers for rgb in (False, True) for recycle in (True, False)]


def run(work: str, episodes: int, batch: int, max_batches: int, rounds: int, tables: tuple[str, ...] = TABLES,
        workers: tuple[int, ...] = (0, 1, 2), loader_batches: int = 60) -> dict:
    eps = gr00t_episodes(work, episodes)
    res = {"episodes": episodes, "frames": sum(len(f) for f, _ in eps), "loadavg": os.getloadavg(), "batch": batch,
           "window": 65536, "tables": list(tables)}
    roots = {}
    for block in (4, 8, 16, 32) if "body" in tables else (16,):
        roots[block] = os.path.join(work, f"b{block}")
        write_root(roots[block], eps, block)
    runs: dict[str, list] = {}
    outputs: dict[str, list] = {}
    for _ in range(rounds):  # interleaved: load drifts on a shared machine, ratios stay comparable
        if "body" in tables:
            for name, block, order_run, cache in CONFIGS:
                runs.setdefault(name, []).append(worker_row(roots[block], batch, max_batches, order_run, 65536, cache))
            runs.setdefault("zstd limit (B=16 blocks from RAM)", []).append(zstd_limit(roots[16]))
        if "output" in tables:
            for name, w, rgb, recycle in output_configs(workers):
                outputs.setdefault(name, []).append(output_row(roots[16], batch, loader_batches, w, rgb, recycle))
    res["rows"] = {name: _medians(rows) for name, rows in runs.items()}
    res["output"] = {name: _medians(rows) for name, rows in outputs.items()}
    res["output_workers"], res["loader_batches"] = list(workers), loader_batches
    if "order" in tables:
        res["order"] = order_table()
        res["locate"] = locate_cost()
    res["loadavg_end"] = os.getloadavg()
    return res


def output_markdown(res: dict) -> list[str]:
    """One row per (workers, output): recycled against fresh output buffers, side by side."""
    lines = ["| workers | output | samples/s recycled | samples/s fresh | recycled / fresh | samples/CPU-s "
             "recycled | samples/CPU-s fresh |", "|---|---|---|---|---|---|---|"]
    got = res.get("output", {})
    for w in res.get("output_workers", ()):
        for out in ("NV12", "float RGB"):
            a, b = got.get(f"W={w} {out} recycled"), got.get(f"W={w} {out} fresh")
            if a and b:
                lines.append(f"| {w} | {out} | {a['samples_per_s']:,.0f} | {b['samples_per_s']:,.0f} | "
                             f"{a['samples_per_s'] / b['samples_per_s']:.2f} | {a['samples_per_cpu_s']:,.0f} | "
                             f"{b['samples_per_cpu_s']:,.0f} |")
    return lines


def _medians(rows: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rows])) for k in rows[0]}


def markdown(res: dict) -> str:
    tables = []
    if res["rows"]:
        lines = ["| worker body | samples/s | CPU us/sample | block decodes/sample |", "|---|---|---|---|"]
        for name, r in res["rows"].items():
            if "samples_per_s" in r:
                lines.append(f"| {name} | {r['samples_per_s']:,.0f} | {r['cpu_us_per_sample']:.0f} | "
                             f"{r['block_decodes_per_sample']:.3f} |")
            else:
                lines.append(f"| {name} | {r['frames_per_s']:,.0f} frames/s | - | - |")
        tables.append(lines)
    if res.get("order"):
        tables.append(["| order | distinct episodes | distinct blocks | same-episode pairs | decodes/sample (sim.) |",
                       "|---|---|---|---|---|"] +
                      [f"| {d['order']} | {d['distinct_episodes']:.2f} | {d['distinct_blocks']:.2f} | "
                       f"{d['same_episode_pairs']:.3f} | {d['decodes_per_sample']:.3f} |" for d in res["order"]])
    if res["output"]:
        tables.append(output_markdown(res))
    return "\n\n".join("\n".join(lines) for lines in tables)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per-rank micro batch")
    p.add_argument("--max-batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of each is reported")
    p.add_argument("--tables", default=",".join(TABLES),
                   help="comma-separated, of body (the worker body per block size), order (the order and "
                        "locate tables), output (the whole loader: NV12/RGB out, recycled/fresh buffers)")
    p.add_argument("--workers", default="0,1,2", help="decode worker counts of the output table")
    p.add_argument("--loader-batches", type=int, default=60, help="timed batches per pass of the output table")
    p.add_argument("--workdir", help="where the data is generated (default: a temp dir, removed)")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    tables = tuple(t for t in args.tables.split(",") if t)
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise SystemExit(f"--tables: unknown {sorted(unknown)}; choose from {', '.join(TABLES)}")
    with tempfile.TemporaryDirectory(prefix="block-loader-", dir=args.workdir) as work:
        res = run(work, args.episodes, args.batch, args.max_batches, args.rounds, tables,
                  tuple(int(w) for w in args.workers.split(",")), args.loader_batches)
    print(markdown(res))
    write_timestamped(args.out, "block-loader", res)
    return 0
