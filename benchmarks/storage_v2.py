"""Storage of format 2 against the source mp4 and format 1, with decode CPU per frame.

    python -m loongforge.benchmarks.storage_v2                      # 4 episodes x 200-300 frames
    python -m loongforge.benchmarks.storage_v2 --episodes 2 --frames 60 80 --blocks 4,16   # quick

On GR00T-shaped data (`sample_data` preset gr00t-like: one 256x256 H.264
camera, 20 fps, GOP 20, 44-D state/action; every timestep a sample): the
mp4s are decoded once (PyAV, as preprocess does), then written as real roots:
format 2 with blocks of B frames for each B (`RootWriterV2`, shards + tables +
index.json), and format 1 with K=1, stride 1, H=16 (one sample per timestep,
what GR00T semantics cost in v1). Bytes are the whole root on disk over the
source mp4 bytes. Decode CPU per frame is `time.thread_time` over reading every
frame back through the library reader (range read + xxh3 + zstd into a reused
buffer; v1: its per-sample reader), best of `--repeats`. Prints a markdown
table, writes benchmarks/results/storage-v2-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np

from loongforge.benchmarks.report import write_timestamped
from loongforge.preprocess.decode import decode_nv12
from loongforge.preprocess.discover import discover
from loongforge.preprocess.episode import read_episode
from loongforge.preprocess.sample_data import generate_preset
from loongforge.shared import paths
from loongforge.shared.dataset_v2 import open_v2
from loongforge.shared.format import Sample, decompress_into, pack_sample
from loongforge.shared.index import ShardIndex, save_index
from loongforge.shared.reader import ShardReader
from loongforge.shared.writer import write_shard
from loongforge.shared.writer_v2 import RootWriterV2

H = 16  # v1 action horizon (GR00T's)


def load_source(root: str) -> tuple[list, dict, int]:
    """[(episode, {slot: nv12}, table)], dataset info, mp4 bytes."""
    meta, episodes = discover(root)
    out, mp4 = [], 0
    for spec in episodes:
        table = read_episode(spec, meta)
        frames = {}
        for key, path in spec.videos:
            frames[paths.camera_slot(key)] = decode_nv12(path, table.length)[0]
            mp4 += os.path.getsize(path)
        out.append((spec.index, frames, table))
    h, w = out[0][1][meta.cameras[0].slot].shape[1:]
    from loongforge.shared.synthetic_v2 import synthetic_dataset_info

    info = synthetic_dataset_info(h * 2 // 3, w, tuple(c.slot for c in meta.cameras), meta.state_dim,
                                  meta.action_dim)
    return out, info, mp4


def _root_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _cpu_best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def measure_v2(work: str, episodes, info, block: int, repeats: int) -> dict:
    from loongforge.preprocess.convert import episode_arrays

    root = os.path.join(work, f"v2-b{block}")
    t = time.thread_time()
    with RootWriterV2(root, info, block_size=block) as w:
        for ep, frames, table in episodes:
            w.add_episode(ep, frames, episode_arrays(table))
    encode_cpu = time.thread_time() - t
    ds = open_v2(root)
    buf = np.empty((block, *ds.frame_shape(ds.cameras[0])), np.uint8)

    def read_all():
        for e in range(ds.num_episodes):
            for cam in ds.cameras:
                for b in range(ds.num_blocks(e)):
                    ds.read_block(e, cam, b, out=buf)

    frames = ds.num_frames * len(ds.cameras)
    cpu = _cpu_best(read_all, repeats)
    nblocks = int(ds.manifest["blocks"])
    return {"format": f"v2 B={block}", "bytes": _root_bytes(root), "frames": frames,
            "decode_cpu_us_per_frame": cpu / frames * 1e6, "encode_cpu_us_per_frame": encode_cpu / frames * 1e6,
            # a sample read out of order decodes its whole block (until a block cache holds it)
            "decode_cpu_us_per_block": cpu / nblocks * 1e6}


def measure_v1(work: str, episodes, info, repeats: int) -> dict:
    """K=1, stride 1, H=16: one sample per timestep, each its own frame, state row and action chunk."""
    import dataclasses

    root = os.path.join(work, "v1-k1")
    t = time.thread_time()
    fragments = []
    for ep, frames, table in episodes:
        n = table.length
        for f in range(n):
            rows = np.minimum(np.arange(f, f + H), n - 1)
            s = Sample(key=paths.sample_key(ep, f), episode=ep, frame_indices=table.frame_index[f : f + 1],
                       timestamps=table.timestamps[f : f + 1], frames={k: v[f : f + 1] for k, v in frames.items()},
                       state=table.state[f : f + 1], action=table.action[rows], action_valid=min(H, n - f),
                       task="task", task_index=int(table.task_index[f]))
            fragments.append((s.key, 1, pack_sample(s)))
    entries, per = [], 2000
    for i in range(0, len(fragments), per):
        entries.append(write_shard(root, paths.shard_name(i // per), fragments[i : i + per]))
    encode_cpu = time.thread_time() - t
    ds = dataclasses.replace(info, frames_per_sample=1, action_horizon=H)
    save_index(ShardIndex(dataset=ds, shards=tuple(entries), episodes=len(episodes)), root)
    reader = ShardReader(root)
    buf = np.empty((1, info.height * 3 // 2, info.width), np.uint8)
    slots = info.slots

    def read_all():
        for n in range(len(reader)):
            parts = reader.parts(n)  # range read + xxh3 + tar headers
            for slot in slots:
                decompress_into(parts.frames_blob(slot), buf)

    frames = len(reader) * len(slots)
    cpu = _cpu_best(read_all, repeats)
    return {"format": "v1 K=1 stride 1", "bytes": _root_bytes(root), "frames": frames,
            "decode_cpu_us_per_frame": cpu / frames * 1e6, "encode_cpu_us_per_frame": encode_cpu / frames * 1e6}


def markdown(doc: dict) -> str:
    lines = ["| format | bytes (MB) | x source mp4 | decode CPU per frame (us) | per block = per uncached "
             "sample read (us) | encode CPU per frame (us) |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        block = r.get("decode_cpu_us_per_block", r["decode_cpu_us_per_frame"])
        lines.append(f"| {r['format']} | {r['bytes'] / 1e6:.2f} | {r['over_mp4']:.2f} | "
                     f"{r['decode_cpu_us_per_frame']:.1f} | {block:.0f} | {r['encode_cpu_us_per_frame']:.1f} |")
    lines.append(f"| source mp4 (H.264, GOP {doc['gop']}) | {doc['mp4_bytes'] / 1e6:.2f} | 1.00 | - | - | - |")
    return "\n".join(lines)


def run(work: str, episodes: int, frames: tuple[int, int], blocks: list[int], repeats: int, gop: int) -> dict:
    load_start = os.getloadavg()
    src = os.path.join(work, "gr00t-like")
    generate_preset(src, "gr00t-like", episodes=episodes, frames=frames, gop=gop, quirks=())
    eps, info, mp4 = load_source(src)
    rows = [measure_v1(work, eps, info, repeats)] + [measure_v2(work, eps, info, b, repeats) for b in blocks]
    for r in rows:
        r["over_mp4"] = r["bytes"] / mp4
    return {"benchmark": "storage-v2", "rows": rows, "mp4_bytes": mp4, "frames": sum(t.length for _, _, t in eps),
            "episodes": episodes, "gop": gop, "resolution": [info.height, info.width], "repeats": repeats,
            "load_avg": load_start, "host": platform.node()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loongforge.benchmarks.storage_v2", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--frames", type=int, nargs=2, default=(200, 300), metavar=("A", "B"))
    p.add_argument("--blocks", default="4,8,16,32", help="block sizes B to compare (4,8,16,32)")
    p.add_argument("--gop", type=int, default=20, help="source keyframe interval (20, the gr00t-like preset's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    with tempfile.TemporaryDirectory(prefix="storage-v2-") as work:
        doc = run(work, args.episodes, tuple(args.frames), blocks, args.repeats, args.gop)
    doc["load_avg_end"] = os.getloadavg()
    print(markdown(doc))
    print(f"\n{doc['frames']} frames, {doc['episodes']} episodes; load average {doc['load_avg'][0]:.2f} -> "
          f"{doc['load_avg_end'][0]:.2f}")
    write_timestamped(args.out, "storage-v2", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
