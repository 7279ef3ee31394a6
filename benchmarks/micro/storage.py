"""Storage of the shard root against the source mp4, with decode CPU per frame of each.

    loongforge bench storage                                       # grain + camera footage, 4 episodes each
    loongforge bench storage --footage camera --episodes 2 --frames 60 80 --blocks 4,16   # quick
    loongforge bench storage --footage "" --lerobot /data/my_lerobot_root                 # your real footage

On GR00T-shaped data (`sample_data` preset gr00t-like: one 256x256 H.264 camera, 20 fps,
GOP 20, 44-D state/action; every timestep a sample), for each `--footage` kind: `grain` (the
default sample footage: a scrolling noise texture, every pixel changes every frame: the worst
case for storing decoded frames) and `camera` (preprocess/samples/camera.py's fixed robot camera model:
static scene, moving arm and cube, sensor noise before x264). The baseline is the source mp4
itself, what an on-the-fly loader reads today: its bytes, and the CPU its sequential decode to
NV12 costs per frame (PyAV, one thread, as preprocess decodes; a random sample read costs more:
it decodes from the keyframe before it). The mp4s are decoded once, then written as real roots
with blocks of B frames for each B and each block codec (`RootWriter`: shards + tables +
index.json). Bytes are the whole root on disk over the source mp4 bytes; "block ratio" is raw
NV12 bytes over the stored block bytes (~17.7:1 measured for 16-frame blocks of the real GR00T
demo data). Decode CPU per frame is `time.thread_time` over reading every frame back through the
library reader (range read + xxh3 + zstd (+ the codec's inverse) into a reused buffer), best of
`--repeats`. Loader samples/s: the decode worker's body (block_loader.worker_row: the block
filler over BlockLoader's order, run 4, 256 MiB LRU, one process) for `--loader-batches` batches
of 32. `--levels 3,9` adds rows at other zstd levels for B=`--level-block`. `--lerobot ROOT`
measures an existing LeRobot v2.x root instead (real footage: its own mp4s are the reference,
its own GOP and codec). Prints markdown tables, writes results/storage-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from loongforge.benchmarks.harness.dataset import RootWriter, open_root, synthetic_dataset_info
from loongforge.benchmarks.harness.report import RESULTS_DIR, write_timestamped
from loongforge.shared import paths
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.stages.episode import read_episode
from loongforge.preprocess.stages.convert import episode_arrays
from loongforge.benchmarks.loader.block_loader import worker_row
from loongforge.preprocess.samples.dataset import generate_preset
from loongforge.preprocess.stages.discover import discover as _discover


def load_source(root: str) -> tuple[list, dict, int, float]:
    """[(episode, {slot: nv12}, table)], dataset info, mp4 bytes, CPU seconds of decoding the mp4s."""
    meta, episodes = discover(root)
    out, mp4, decode_cpu = [], 0, 0.0
    for spec in episodes:
        table = read_episode(spec, meta)
        frames = {}
        for key, path in spec.videos:
            t = time.process_time()  # one decoding thread (decode_nv12's default), whatever the process holds
            frames[paths.camera_slot(key)] = decode_nv12(path, table.length)[0]
            decode_cpu += time.process_time() - t
            mp4 += os.path.getsize(path)
        out.append((spec.index, frames, table))
    h, w = out[0][1][meta.cameras[0].slot].shape[1:]
    info = synthetic_dataset_info(h * 2 // 3, w, tuple(c.slot for c in meta.cameras), meta.state_dim,
                                  meta.action_dim)
    return out, info, mp4, decode_cpu


def _root_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _cpu_best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def _write_root(root: str, episodes, info, block: int, codec: str, level: int) -> float:
    """Write the root; returns the encode CPU seconds."""
    t = time.thread_time()
    with RootWriter(root, info, block_size=block, block_codec=codec, zstd_level=level) as w:
        for ep, frames, table in episodes:
            w.add_episode(ep, frames, episode_arrays(table))
    return time.thread_time() - t


def _reader(ds, block: int):
    """A function reading every block of `ds` through the library reader into one reused buffer."""
    buf = np.empty((block, *ds.frame_shape(ds.cameras[0])), np.uint8)

    def read_all():
        for e in range(ds.num_episodes):
            for cam in ds.cameras:
                for b in range(ds.num_blocks(e)):
                    ds.read_block(e, cam, b, out=buf)
    return read_all, buf


def measure_root(work: str, episodes, info, block: int, repeats: int, codec: str = "zstd", level: int = 3,
                 loader_batches: int = 0) -> dict:
    root = os.path.join(work, f"b{block}-{codec}-{level}")
    encode_cpu = _write_root(root, episodes, info, block, codec, level)
    ds = open_root(root)
    read_all, buf = _reader(ds, block)

    frames = ds.num_frames * len(ds.cameras)
    cpu = _cpu_best(read_all, repeats)
    nblocks = int(ds.manifest["blocks"])
    stored = int(np.asarray(ds.tables["blocks"])[:, 1].sum())
    row = {"format": f"blocks B={block}", "codec": codec, "zstd_level": level, "bytes": _root_bytes(root),
           "frames": frames, "block_ratio": frames * buf[0].nbytes / stored,
           "decode_cpu_us_per_frame": cpu / frames * 1e6, "encode_cpu_us_per_frame": encode_cpu / frames * 1e6,
           # a sample read out of order decodes its whole block (until a block cache holds it)
           "decode_cpu_us_per_block": cpu / nblocks * 1e6}
    if loader_batches:
        row.update(_loader(root, loader_batches, min(32, ds.num_frames)))
    shutil.rmtree(root)  # the loader read it; keep the work dir small
    return row


def codec_decode_cost(work: str, episodes, info, block: int, codecs: list[str], rounds: int) -> dict:
    """Decode CPU per frame of each codec on the same frames, reads interleaved round by round
    (a shared machine's load drifts; the median of each codec's rounds is reported)."""
    readers, times = {}, {c: [] for c in codecs}
    for codec in codecs:
        root = os.path.join(work, f"decode-{codec}")
        _write_root(root, episodes, info, block, codec, 3)
        ds = open_root(root)
        readers[codec] = (_reader(ds, block)[0], ds.num_frames * len(ds.cameras))
    for _ in range(rounds):
        for codec, (read_all, frames) in readers.items():
            t = time.thread_time()
            read_all()
            times[codec].append((time.thread_time() - t) / frames * 1e6)
    for codec in codecs:
        shutil.rmtree(os.path.join(work, f"decode-{codec}"))
    return {"block": block, "rounds": rounds, "us_per_frame": {c: float(np.median(v)) for c, v in times.items()},
            "all_us_per_frame": times}


def _loader(root: str, batches: int, batch: int) -> dict:
    """The decode worker's body over the loader's order (block_loader.worker_row, 1 worker, 256 MiB LRU)."""
    r = worker_row(root, batch=batch, max_batches=batches, run=4, window=65536)
    return {"loader_samples_per_s": r["samples_per_s"], "loader_cpu_us_per_sample": r["cpu_us_per_sample"],
            "loader_block_decodes_per_sample": r["block_decodes_per_sample"]}


def markdown(part: dict) -> str:
    lines = ["| format | block codec | zstd level | bytes (MB) | x source mp4 | block ratio (raw:stored) | decode CPU "
             "per frame (us) | per block = per uncached sample read (us) | encode CPU per frame (us) | loader "
             "samples/s (1 worker) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in part["rows"]:
        block = r.get("decode_cpu_us_per_block", r["decode_cpu_us_per_frame"])
        loader = f"{r['loader_samples_per_s']:.0f}" if "loader_samples_per_s" in r else "-"
        lines.append(f"| {r['format']} | {r['codec']} | {r['zstd_level']} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['over_mp4']:.2f} | {r['block_ratio']:.1f} | {r['decode_cpu_us_per_frame']:.1f} | "
                     f"{block:.0f} | {r['encode_cpu_us_per_frame']:.1f} | {loader} |")
    src = f"source mp4 ({part['gop']})" if "source" in part else f"source mp4 (H.264 CRF 23, GOP {part['gop']})"
    lines.append(f"| {src} | - | - | {part['mp4_bytes'] / 1e6:.2f} | 1.00 | "
                 f"{part['raw_bytes'] / part['mp4_bytes']:.0f} | {part['mp4_decode_cpu_us_per_frame']:.1f} "
                 "(sequential, to NV12) | - | - | - |")
    return "\n".join(lines)


def run_footage(work: str, footage: str, args) -> dict:
    src = os.path.join(work, f"gr00t-like-{footage}")
    generate_preset(src, "gr00t-like", episodes=args.episodes, frames=tuple(args.frames), gop=args.gop, quirks=(),
                    footage=footage)
    eps, info, mp4, decode_cpu = load_source(src)
    shutil.rmtree(src)
    return measure_source(work, eps, info, mp4, decode_cpu, args, gop=args.gop)


def run_lerobot(work: str, root: str, args) -> dict:
    """The same table on an existing LeRobot root: its mp4s (codec, GOP, bitrate as recorded) are the reference."""
    eps, info, mp4, decode_cpu = load_source(root)
    # the loader column's worker body is built for the gr00t-like shape (block_loader.worker_row): not measured here
    part = measure_source(work, eps, info, mp4, decode_cpu, argparse.Namespace(**{**vars(args), "loader_batches": 0}),
                          gop=_source_gop(root))
    part["episodes"], part["source"] = len(eps), os.path.abspath(root)
    return part


def _source_gop(root: str) -> str:
    """'codec, keyframes/frames' of the root's first mp4 (what the source costs per frame depends on it)."""
    import av


    path = _discover(root)[1][0].videos[0][1]
    with av.open(path) as c:
        keys = [p.is_keyframe for p in c.demux(video=0) if p.size]
        name = c.streams.video[0].codec_context.name
    return f"{name}, {sum(keys)} keyframes in {len(keys)} frames"


def measure_source(work: str, eps, info, mp4: int, mp4_decode_cpu: float, args, gop) -> dict:
    rows = []
    for b in args.blocks:
        rows += [measure_root(work, eps, info, b, args.repeats, codec, 3, args.loader_batches)
                 for codec in args.codecs]
    for level in (lv for lv in args.levels if lv != 3):
        rows += [measure_root(work, eps, info, args.level_block, args.repeats, codec, level) for codec in args.codecs]
    decode = codec_decode_cost(work, eps, info, args.level_block, args.codecs, args.decode_rounds) \
        if args.decode_rounds else None
    raw = sum(f.nbytes for _, frames, _ in eps for f in frames.values())
    for r in rows:
        r["over_mp4"] = r["bytes"] / mp4
    frames = sum(t.length for _, _, t in eps)
    return {"rows": rows, "decode_interleaved": decode, "mp4_bytes": mp4, "raw_bytes": raw,
            "mp4_decode_cpu_us_per_frame": mp4_decode_cpu / (frames * len(info.slots)) * 1e6,
            "frames": frames, "episodes": args.episodes, "gop": gop,
            "resolution": [info.height, info.width]}


def _csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--footage", default="grain,camera", help="sample footage kinds (grain,camera; FOOTAGE_KINDS)")
    p.add_argument("--lerobot", default="", help="comma-separated LeRobot roots to measure as they are (real footage)")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--frames", type=int, nargs=2, default=(200, 300), metavar=("A", "B"))
    p.add_argument("--blocks", default="4,8,16,32", help="block sizes B to compare (4,8,16,32)")
    p.add_argument("--codecs", default="zstd,delta-zstd", help="block codecs to compare (zstd,delta-zstd)")
    p.add_argument("--levels", default="3", help="zstd levels: 3 for every B; others only at --level-block")
    p.add_argument("--level-block", type=int, default=16)
    p.add_argument("--decode-rounds", type=int, default=7,
                   help="interleaved decode-CPU rounds per codec at B=--level-block (0: skip)")
    p.add_argument("--loader-batches", type=int, default=20, help="batches of 32 for the loader column (0: skip)")
    p.add_argument("--gop", type=int, default=20, help="source keyframe interval (20, the gr00t-like preset's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    if not _csv(args.footage) and not _csv(args.lerobot):
        print("loongforge bench storage: error: nothing to measure: give --footage kinds and/or --lerobot roots",
              file=sys.stderr)
        return 2
    args.blocks, args.codecs, args.levels = _csv(args.blocks, int), _csv(args.codecs), _csv(args.levels, int)
    doc = {"benchmark": "storage", "load_avg": os.getloadavg(), "host": platform.node(), "repeats": args.repeats,
           "codecs": args.codecs, "footage": {}}
    with tempfile.TemporaryDirectory(prefix="storage-") as work:
        sources = [(f, lambda f=f: run_footage(work, f, args)) for f in _csv(args.footage)] + \
            [(f"lerobot:{r}", lambda r=r: run_lerobot(work, r, args)) for r in _csv(args.lerobot)]
        for footage, run in sources:
            doc["footage"][footage] = part = run()
            print(f"\n{footage} footage: {part['frames']} frames, {part['episodes']} episodes, load average "
                  f"{os.getloadavg()[0]:.2f}\n" + markdown(part), flush=True)
            if part["decode_interleaved"]:
                d = part["decode_interleaved"]
                print(f"decode CPU per frame at B={d['block']}, median of {d['rounds']} interleaved rounds: " +
                      ", ".join(f"{c} {us:.1f} us" for c, us in d["us_per_frame"].items()), flush=True)
    doc["load_avg_end"] = os.getloadavg()
    print(f"\nload average {doc['load_avg'][0]:.2f} -> {doc['load_avg_end'][0]:.2f}")
    write_timestamped(args.out, "storage", doc)
    return 0
