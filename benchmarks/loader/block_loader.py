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
output buffers, on GR00T-like camera footage larger than a worker's block cache: samples/s, samples
per CPU-second of the process tree against the inline loader's and against per-core limits measured
in the same run (zstd, memcpy, NV12 -> RGB), frames decompressed per sample, and the CPU per sample by
process (main, workers' fill, workers' rest); and the goals table: the loader against on-the-fly PyAV
decode of each sample's frame, per source GOP (250, 20, 2).

    loongforge bench block-loader --episodes 8                # every table, ~15 min on a 2-core VM
    loongforge bench block-loader --tables output,goals       # the loader's account and goals, ~5 min
    loongforge bench block-loader --tables output,goals --block-cache-mb 1024   # footage inside the cache

Every figure of one run is measured in that run on the same frames; report the ratios with the load
average beside them. Writes results/block-loader-<time>-<host>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict

import numpy as np

from loongforge.benchmarks.harness.cores import CpuMeter
from loongforge.benchmarks.harness.dataset import (BlockFiller, DeltaSpec, RootWriter, SampleTable, batch_diversity,
                                                   block_loader, block_sequence, decode_block, open_root, rank_slice)
from loongforge.benchmarks.harness.measure import time_pass
from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset, Window
from loongforge.shared.index import CameraInfo, DatasetInfo
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.colorspace import nv12_to_input, serial_cpu_ops_in_this_thread
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.samples.dataset import DATA_PATH, VIDEO_PATH, generate_dataset

CAM = "ego_view"
HORIZON = 16


def gr00t_episodes(workdir: str, episodes: int, seed: int = 0, gop: int = 20, footage: str = "grain",
                   name: str = "lerobot") -> list[tuple[np.ndarray, dict]]:
    """[(NV12 (T, 384, 256), arrays)] decoded from a generated GR00T-like LeRobot dataset (written
    under workdir/name: the on-the-fly baseline of the goals table reads its mp4s)."""
    import pyarrow.parquet as pq

    root = generate_dataset(os.path.join(workdir, name), episodes=episodes, frames=(150, 300), height=256,
                            width=256, fps=20, cameras=(CAM,), state_dim=44, action_dim=44, gop=gop, seed=seed,
                            footage=footage)
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


def zstd_limit(root: str, camera: str = CAM) -> dict:
    """Decompress every block of a B=16 root from RAM (bytes read first): the ceiling."""
    ds = open_root(root)
    blobs = []
    for e in range(ds.num_episodes):
        for b in range(ds.num_blocks(e)):
            name, off, length, n, _ = ds.block_entry(e, camera, b)
            blobs.append((bytes(ds.source.read_range(name, off, length)), n))
    out = np.empty((ds.block_size, *ds.frame_shape(camera)), np.uint8)
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


def output_row(root: str, batch: int, batches: int, workers: int, rgb: bool, recycle: bool,
               warmup: int = 1, cache_mb: float = 256) -> dict:
    """The whole loader on CPU (rank 0 of 1, K=1, H=16, default order and cache): NV12 or float RGB out,
    recycled output buffers or a fresh one per batch; timed once every worker is up (`wait_ready`).
    The CPU account per sample: the main process (order, IPC, staging, conversion) and, for workers, their
    fill (BlockFiller.fill: block decode + copies, its own thread's CPU) and the rest of each worker (task
    and result messages, its loop); inline, the fill runs in the main process's prefetch thread."""
    loader = block_loader(root, batch_size=batch, num_workers=workers, rgb=rgb, recycle_buffers=recycle,
                          deltas=DeltaSpec(video=(0,), action_horizon=HORIZON), block_cache_mb=cache_mb)
    meter = CpuMeter()
    at_start = {}

    def ready():
        settle = loader.wait_ready()
        for _ in range(settle):
            next(it)
        at_start.update(loader.cache_counters())  # as of the batches received so far
        return 0

    try:
        it = iter(loader)
        p = time_pass(it, warmup=warmup, timed=batches, meter=meter, ready=ready)
        end = loader.cache_counters()
        lent = loader._lender.lent if loader._lender is not None else 0
        block = loader.block_size
    finally:
        loader.close()
    n = max(1, p.samples)
    fill = end.get("fill_cpu_s", 0.0) - at_start.get("fill_cpu_s", 0.0)
    main_us, tree_us, fill_us = meter.own_s / n * 1e6, meter.cpu_s / n * 1e6, fill / n * 1e6
    return {"samples_per_s": p.samples_per_s, "samples_per_cpu_s": p.samples_per_cpu_s, "main_us": main_us,
            "workers_fill_us": fill_us if workers else 0.0,
            "workers_other_us": max(0.0, tree_us - main_us - fill_us) if workers else 0.0,
            "inline_fill_us": 0.0 if workers else fill_us, "lent_batches": lent,
            # frames zstd-decompressed per sample delivered: block misses (decodes) x frames per block
            "decoded_frames_per_sample": (end.get("misses", 0) - at_start.get("misses", 0)) * block / n}


def limits(root: str, batch: int = 32, seconds: float = 1.0, camera: str = CAM) -> dict:
    """What one core does at best, on the same root in the same run, frames/s: zstd decompression of its
    blocks from RAM (the bytes read first), a frame's copy (memcpy: decoded frames, more of them than the
    L3 holds, into a ring of batch buffers, as a fill does), and NV12 -> normalized float RGB of a batch
    into a recycled buffer (the prefetch thread's pass, serial as it runs it)."""
    import torch

    out = {"zstd_frames_per_s": zstd_limit(root, camera)["frames_per_s"]}
    ds = open_root(root)
    frames = []
    for e in range(ds.num_episodes):
        for b in range(ds.num_blocks(e)):
            frames.extend(ds.read_block(e, camera, b))
            if len(frames) >= 2048:  # 2048 x 96 KiB: 6x the L3 of the machine this was written on
                break
        if len(frames) >= 2048:
            break
    ring = [np.empty((batch, *frames[0].shape), np.uint8) for _ in range(5)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst = ring[(n // batch) % len(ring)]
        for i in range(batch):
            dst[i] = frames[(n + i * 7919) % len(frames)]  # scattered sources, as a batch's samples are
        n += batch
    out["memcpy_frames_per_s"] = n / (time.perf_counter() - t0)
    info = ds.info
    src = torch.from_numpy(np.stack(frames[:batch]))[:, None]  # (B, 1, 3h/2, w) as the loader's field
    dst = torch.empty(src.numel() * 2, dtype=torch.float32)  # (B, 1, 3, h, w) float from (B, 1, 3h/2, w)
    got = {}

    def convert():
        serial_cpu_ops_in_this_thread()
        nv12_to_input(src, info.color_matrix, info.color_range, mean=0.5, std=0.5, out=dst)  # warm (compile)
        k, t1 = 0, time.perf_counter()
        while time.perf_counter() - t1 < seconds:
            nv12_to_input(src, info.color_matrix, info.color_range, mean=0.5, std=0.5, out=dst)
            k += batch
        got["conversion_frames_per_s"] = k / (time.perf_counter() - t1)

    th = threading.Thread(target=convert)
    th.start()
    th.join()
    out.update(got)
    return out


def baseline_rate(lerobot_root: str, episodes, seconds: float = 3.0, seed: int = 0) -> dict:
    """On-the-fly PyAV decode of each sample's frame in one process (the GR00T/LeRobot way: open, seek to
    the keyframe, decode to the frame), random samples of the same episodes; torch on one thread (its best)."""
    import torch

    lengths = [len(nv12) for nv12, _ in episodes]
    ids = np.random.default_rng(seed).permutation(sum(lengths))
    ends = np.cumsum(lengths)
    windows = []
    for i in ids[:4096].tolist():
        e = int(np.searchsorted(ends, i, side="right"))
        t = i - (int(ends[e - 1]) if e else 0)
        windows.append(Window(e, t, (t,)))
    ds = LeRobotVideoDataset(lerobot_root, windows, action_horizon=HORIZON, cameras=(f"observation.images.{CAM}",))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds[0]
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n < 10:
            ds[1 + n % (len(ds) - 1)]
            n += 1
        return {"samples_per_s": n / (time.perf_counter() - t0), "samples": n}
    finally:
        torch.set_num_threads(threads)


GOAL_ROWS = ((0, False), (0, True), (2, False), (2, True))  # (workers, float RGB out)
GOALS = {250: (400, 300), 2: (40, 30)}  # GOP -> (NV12, float RGB) goal ratios over on-the-fly decode


def goals_table(work: str, gops: tuple[int, ...], episodes: int, batch: int, batches: int,
                cache_mb: float = 256) -> list[dict]:
    """Per source GOP: GR00T-like camera footage (256x256 H.264, 20 fps, one camera, 44-D), the on-the-fly
    baseline on its mp4s, and the loader on the shards made from them (K=1, H=16, every timestep a sample)."""
    rows = []
    for gop in gops:
        eps = gr00t_episodes(work, episodes, gop=gop, footage="camera", name=f"lerobot-g{gop}")
        root = os.path.join(work, f"goals-g{gop}")
        write_root(root, eps, 16)
        row = {"gop": gop, "frames": sum(len(f) for f, _ in eps), "loadavg": os.getloadavg(),
               "baseline": baseline_rate(os.path.join(work, f"lerobot-g{gop}"), eps)}
        for w, rgb in GOAL_ROWS:
            row[f"W={w} {'float RGB' if rgb else 'NV12'}"] = output_row(root, batch, batches, w, rgb, True, warmup=20,
                                                                        cache_mb=cache_mb)
        rows.append(row)
        shutil.rmtree(root)
    return rows


def goals_markdown(rows: list[dict]) -> list[str]:
    names = [f"W={w} {'float RGB' if rgb else 'NV12'}" for w, rgb in GOAL_ROWS]
    lines = ["| source GOP | on-the-fly PyAV samples/s | " + " | ".join(f"{n} samples/s (x)" for n in names) +
             " | goal |", "|---" * (3 + len(names)) + "|"]
    for r in rows:
        base = r["baseline"]["samples_per_s"]
        cells = [f"{r[n]['samples_per_s']:,.0f} ({r[n]['samples_per_s'] / base:,.0f}x)" for n in names]
        goal = GOALS.get(r["gop"])
        verdict = "-"
        if goal:
            nv12, rgb = r["W=0 NV12"]["samples_per_s"] / base, r["W=0 float RGB"]["samples_per_s"] / base
            verdict = (f"NV12 >= {goal[0]}x: {'met' if nv12 >= goal[0] else 'MISSED'}; float RGB >= {goal[1]}x: "
                       f"{'met' if rgb >= goal[1] else 'MISSED'}")
        two = all(r[f"W=2 {o}"]["samples_per_s"] >= r[f"W=0 {o}"]["samples_per_s"] for o in ("NV12", "float RGB"))
        verdict += f"; 2 workers >= 0: {'met' if two else 'MISSED'}"
        lines.append(f"| {r['gop']} | {base:,.1f} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


CONFIGS = [(f"B={b} {name}", b, run, cache) for b in (4, 8, 16, 32)
           for name, run, cache in (("run=4, 1 worker (256 MiB LRU)", 4, None),
                                    ("run=4, fleet (reuse within batch)", 4, 2), ("run=1, fleet (random order)", 1, 2))]
TABLES = ("body", "order", "output", "goals")


def output_configs(workers: tuple[int, ...]) -> list[tuple[str, int, bool, bool]]:
    return [(f"W={w} {'float RGB' if rgb else 'NV12'} {'recycled' if recycle else 'fresh'}", w, rgb, recycle)
            for w in workers for rgb in (False, True) for recycle in (True, False)]


def run(work: str, episodes: int, batch: int, max_batches: int, rounds: int, tables: tuple[str, ...] = TABLES,
        workers: tuple[int, ...] = (0, 1, 2), loader_batches: int = 300, camera_episodes: int = 16,
        gops: tuple[int, ...] = (250, 20, 2), cache_mb: float = 256) -> dict:
    res = {"episodes": episodes, "loadavg": os.getloadavg(), "batch": batch, "window": 65536, "tables": list(tables),
           "block_cache_mb": cache_mb}
    roots = {}
    if "body" in tables:
        eps = gr00t_episodes(work, episodes)
        res["frames"] = sum(len(f) for f, _ in eps)
        for block in (4, 8, 16, 32):
            roots[block] = os.path.join(work, f"b{block}")
            write_root(roots[block], eps, block)
    if "output" in tables:  # GR00T-like camera footage (compresses as real robot video does), more than the LRU
        eps = gr00t_episodes(work, camera_episodes, footage="camera", name="lerobot-camera")
        res["output_frames"] = sum(len(f) for f, _ in eps)
        roots["output"] = os.path.join(work, "output-b16")
        write_root(roots["output"], eps, 16)
        del eps
    runs: dict[str, list] = {}
    outputs: dict[str, list] = {}
    caps: list[dict] = []
    for _ in range(rounds):  # interleaved: load drifts on a shared machine, ratios stay comparable
        if "body" in tables:
            for name, block, order_run, cache in CONFIGS:
                runs.setdefault(name, []).append(worker_row(roots[block], batch, max_batches, order_run, 65536, cache))
            runs.setdefault("zstd limit (B=16 blocks from RAM)", []).append(zstd_limit(roots[16]))
        if "output" in tables:
            caps.append(limits(roots["output"], batch))
            for name, w, rgb, recycle in output_configs(workers):
                outputs.setdefault(name, []).append(output_row(roots["output"], batch, loader_batches, w, rgb,
                                                               recycle, warmup=20, cache_mb=cache_mb))
    res["rows"] = {name: _medians(rows) for name, rows in runs.items()}
    res["output"] = {name: _medians(rows) for name, rows in outputs.items()}
    res["limits"] = _medians(caps) if caps else {}
    res["output_workers"], res["loader_batches"] = list(workers), loader_batches
    if "order" in tables:
        res["order"] = order_table()
        res["locate"] = locate_cost()
    if "goals" in tables:
        res["goals"] = goals_table(work, gops, camera_episodes, batch, loader_batches, cache_mb)
    res["loadavg_end"] = os.getloadavg()
    return res


def output_markdown(res: dict) -> list[str]:
    """One row per (workers, output): recycled against fresh output buffers side by side, the recycled
    loader's samples per CPU-second against the inline one's and against the slowest per-core limit of
    its work (NV12: zstd and memcpy; float RGB: also the conversion), and its CPU per sample by process."""
    lim = res.get("limits") or {}
    nv12_cap = min([lim[k] for k in ("zstd_frames_per_s", "memcpy_frames_per_s") if k in lim], default=0)
    rgb_cap = min([nv12_cap, lim.get("conversion_frames_per_s", nv12_cap)]) if nv12_cap else 0
    lines = ["| workers | output | samples/s recycled | samples/s fresh | recycled / fresh | samples/CPU-s recycled | "
             "per CPU-s vs inline | vs slowest limit | frames decompressed / sample | at the limits' cost | "
             "main us/sample | workers' fill us/sample | workers' other us/sample | inline fill us/sample |",
             "|---" * 14 + "|"]
    got = res.get("output", {})
    for w in res.get("output_workers", ()):
        for out in ("NV12", "float RGB"):
            a, b = got.get(f"W={w} {out} recycled"), got.get(f"W={w} {out} fresh")
            if not (a and b):
                continue
            inline = got.get(f"W=0 {out} recycled")
            per = a["samples_per_cpu_s"] / inline["samples_per_cpu_s"] if inline and inline["samples_per_cpu_s"] \
                else float("nan")
            cap = nv12_cap if out == "NV12" else rgb_cap
            vs = f"{a['samples_per_cpu_s'] / cap:.2f}" if cap else "-"
            lines.append(f"| {w} | {out} | {a['samples_per_s']:,.0f} | {b['samples_per_s']:,.0f} | "
                         f"{a['samples_per_s'] / b['samples_per_s']:.2f} | {a['samples_per_cpu_s']:,.0f} | {per:.2f} | "
                         f"{vs} | {a.get('decoded_frames_per_sample', 0):.2f} | {_at_limits(a, lim, out)} | "
                         f"{a.get('main_us', 0):.1f} | {a.get('workers_fill_us', 0):.1f} | "
                         f"{a.get('workers_other_us', 0):.1f} | {a.get('inline_fill_us', 0):.1f} |")
    if lim:
        lines.append("")
        lines.append("Per-core limits, same root, same run (frames/s): " + ", ".join(
            f"{k.replace('_frames_per_s', '')} {v:,.0f}" for k, v in lim.items()))
    return lines


def _at_limits(row: dict, lim: dict, out: str) -> str:
    """The row's own work at the per-core limits (its decompressed frames at zstd speed, one frame's copy,
    float RGB: one conversion) as a share of its measured CPU per sample: 1.00 = nothing but that work."""
    if not lim or not row.get("samples_per_cpu_s"):
        return "-"
    need = row.get("decoded_frames_per_sample", 0) / lim["zstd_frames_per_s"] + 1 / lim["memcpy_frames_per_s"]
    if out != "NV12":
        need += 1 / lim["conversion_frames_per_s"]
    return f"{need * row['samples_per_cpu_s']:.2f}"


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
    if res.get("goals"):
        tables.append(goals_markdown(res["goals"]))
    return "\n\n".join("\n".join(lines) for lines in tables)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per-rank micro batch")
    p.add_argument("--max-batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of each is reported")
    p.add_argument("--tables", default=",".join(TABLES),
                   help="comma-separated, of body (the worker body per block size), order (the order and "
                        "locate tables), output (the whole loader: NV12/RGB out, recycled/fresh buffers, the CPU "
                        "account and per-core limits), goals (against on-the-fly PyAV decode per source GOP)")
    p.add_argument("--workers", default="0,1,2", help="decode worker counts of the output table")
    p.add_argument("--loader-batches", type=int, default=300, help="timed batches per pass of the output and "
                   "goals tables")
    p.add_argument("--camera-episodes", type=int, default=16, help="episodes of GR00T-like camera footage for the "
                   "output and goals tables (16: ~3,600 frames, more than a worker's 256 MiB block cache holds)")
    p.add_argument("--gops", default="250,20,2", help="source GOPs of the goals table")
    p.add_argument("--block-cache-mb", type=float, default=256, help="each decode worker's block cache in the "
                   "output and goals tables (the loader's default: 256)")
    p.add_argument("--workdir", help="where the data is generated (default: a temp dir, removed)")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    tables = tuple(t for t in args.tables.split(",") if t)
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise SystemExit(f"--tables: unknown {sorted(unknown)}; choose from {', '.join(TABLES)}")
    with tempfile.TemporaryDirectory(prefix="block-loader-", dir=args.workdir) as work:
        res = run(work, args.episodes, args.batch, args.max_batches, args.rounds, tables,
                  tuple(int(w) for w in args.workers.split(",")), args.loader_batches, args.camera_episodes,
                  tuple(int(g) for g in args.gops.split(",")), args.block_cache_mb)
    print(markdown(res))
    write_timestamped(args.out, "block-loader", res)
    return 0
