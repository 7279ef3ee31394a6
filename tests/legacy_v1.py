"""A writer of the retired shard format 1 (shared/FORMAT.md, appendix), for tests of what reads
it: `loongforge convert` (shared/legacy.py) and the readers that must refuse it. LoongForge itself
no longer writes format 1; this independent writer follows the appendix, so a converter test also
checks the converter against the spec rather than against its own code.

    write_v1_root(root, dataset_info, {episode: (frames, arrays)}, frames_per_sample=4, stride=2, ...)

`frames`/`arrays` are those of shared/synthetic.py (or a format-2 root's read_block/read_arrays).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import xxhash
import zstandard

from loongforge.shared import paths, storage
from loongforge.shared.index import DatasetInfo
from loongforge.shared.members import END_OF_ARCHIVE, NV12_SUFFIX, npy_bytes, tar_member


def windows(n: int, k: int, stride: int, horizon: int, min_frames: int) -> list[tuple[list[int], list[int], int]]:
    """(frame rows, action rows, real action rows) of each window of an n-frame episode (frame_step 1)."""
    out = []
    for start in range(0, n, stride):
        rows = list(range(start, min(n, start + k)))
        if len(rows) < min_frames:
            break
        last = rows[-1]
        valid = min(horizon, n - last)
        out.append((rows, [last + min(i, valid - 1) for i in range(horizon)], valid))
    return out


def _sample(episode: int, rows, act_rows, valid, frames: dict, arrays: dict, tasks: dict, cctx) -> tuple[str, bytes]:
    key = f"e{episode:06d}_f{int(arrays['frame_index'][rows[0]]):06d}"
    task_index = int(arrays["task_index"][rows[0]])
    meta = {"format_version": 1, "episode": episode, "frames": [int(arrays["frame_index"][r]) for r in rows],
            "timestamps": [round(float(arrays["timestamp"][r]), 6) for r in rows], "num_frames": len(rows),
            "task_index": task_index, "action_valid": valid, "cameras": sorted(frames)}
    parts = [tar_member(f"{key}.meta.json", json.dumps(meta, sort_keys=True).encode()),
             tar_member(f"{key}.task.txt", tasks.get(str(task_index), "").encode()),
             tar_member(f"{key}.state.npy", npy_bytes(np.asarray(arrays["state"][rows], np.float32))),
             tar_member(f"{key}.action.npy", npy_bytes(np.asarray(arrays["action"][act_rows], np.float32)))]
    for slot in sorted(frames):
        parts.append(tar_member(f"{key}.{slot}{NV12_SUFFIX}", cctx.compress(np.ascontiguousarray(frames[slot][rows]))))
    return key, b"".join(parts)


def write_v1_root(root: str, dataset: DatasetInfo, episodes: dict[int, tuple[dict, dict]], *, frames_per_sample: int,
                  stride: int, action_horizon: int, min_frames: int = 1, shard_size: int = 1 << 16,
                  val_episodes=(), failed=()) -> dict:
    """Write a format-1 root (episodes in id order); returns its index.json document."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, threads=0)
    samples = []
    for ep in sorted(episodes):
        frames, arrays = episodes[ep]
        n = len(arrays["state"])
        for rows, act_rows, valid in windows(n, frames_per_sample, stride, action_horizon, min_frames):
            key, frag = _sample(ep, rows, act_rows, valid, frames, arrays, dataset.tasks, cctx)
            samples.append((key, len(rows), frag))
    groups, current, size = [], [], len(END_OF_ARCHIVE)
    for s in samples:
        if current and size + len(s[2]) > shard_size:
            groups.append(current)
            current, size = [], len(END_OF_ARCHIVE)
        current.append(s)
        size += len(s[2])
    groups += [current] if current else []
    shards, checksums = [], {}
    for number, group in enumerate(groups):
        name = paths.shard_name(number)
        data = b"".join(frag for _, _, frag in group) + END_OF_ARCHIVE
        offsets = np.cumsum([0] + [len(frag) for _, _, frag in group])[:-1].tolist()
        storage.write_bytes_atomic(paths.join(root, name), data)
        shards.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                       "keys": [k for k, _, _ in group], "offsets": offsets,
                       "lengths": [len(frag) for _, _, frag in group], "frames": [k for _, k, _ in group]})
        checksums[name] = [xxhash.xxh3_64_hexdigest(frag) for _, _, frag in group]
    info = dataclasses.replace(dataset, frames_per_sample=frames_per_sample, action_horizon=action_horizon)
    doc = {"format": "loongforge-shards", "format_version": 1, "created_by": "tests.legacy_v1",
           "episodes": len(episodes), "dataset": dataclasses.asdict(info),
           "params": {"frames_per_sample": frames_per_sample, "stride": stride, "action_horizon": action_horizon,
                      "min_frames": min_frames}, "shards": shards, "failed": list(failed), "sample_xxh3": checksums}
    if val_episodes:
        doc["split"] = {"val_episodes": list(val_episodes)}
    storage.write_bytes_atomic(paths.join(root, paths.INDEX_FILE),
                               json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return doc


def v1_copy_of(v2_root: str, out: str, **kw) -> dict:
    """Write `out` as format 1 holding a format-2 root's episodes (frames, arrays, stats, split)."""
    from loongforge.shared.dataset import open_root

    ds = open_root(v2_root)
    episodes = {}
    for e in range(ds.num_episodes):
        frames = {c: np.concatenate([ds.read_block(e, c, b) for b in range(ds.num_blocks(e))]) for c in ds.cameras}
        episodes[int(ds.episode_id(e))] = (frames, ds.read_arrays(e))
    return write_v1_root(out, ds.info, episodes, val_episodes=sorted(ds.val_episodes),
                         failed=ds.manifest["failed"], **kw)
