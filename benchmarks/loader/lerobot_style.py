"""LeRobot's own loading, rebuilt faithfully for timing: `LeRobotDataset(root, video_backend="pyav",
delta_timestamps=...)` over the LeRobot dataset itself (v2.x or v3.0), decoding at train time.

Per item, as lerobot's `__getitem__` and `decode_video_frames_pyav` do it:

1. the episode of the index and its bounds; per key with deltas, the query rows clamped into the
   episode and the `<key>_is_pad` flags;
2. per camera, the query timestamps (the parquet's `timestamp` at the clamped rows) shifted by the
   episode's `from_timestamp` inside its (v3.0: shared) mp4;
3. seek to the keyframe at or before the first timestamp (`round(first / time_base) - 1`, backward,
   keyframes only: PyAV has no accurate seek), decode forward converting EVERY decoded frame to
   rgb24, until a frame reaches the last timestamp; keep per query the nearest decoded frame
   (within tolerance_s, else an error, as LeRobot raises); float32 CHW / 255;
4. open containers are kept in a per-process LRU of 32 (lerobot's PyavCache), so a file is not
   re-opened per item.

The tabular part (state, action, timestamps, task) is read once per episode up front, which is
cheaper than LeRobot's per-item Arrow access: the baseline is timed at its best, so ratios against
it are conservative. `tests/benchmarks/test_lerobot_baseline.py` checks its items against what
lerobot 0.6.1 itself returned (../shared/fixtures/lerobot_v3/video_items.npz), bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.stages.episode import read_table
from loongforge.shared.errors import SourceDataError
from loongforge.train.data.lerobot_items import ACTION_KEY, STATE_KEY, delta_indices, query

CONTAINERS_KEPT = 32  # lerobot's DEFAULT_PYAV_CACHE_SIZE


class _Containers:
    def __init__(self):
        self._open: OrderedDict = OrderedDict()

    def get(self, path: str):
        import av

        got = self._open.get(path)
        if got is None:
            container = av.open(path)
            got = self._open[path] = (container, container.streams.video[0])
            while len(self._open) > CONTAINERS_KEPT:
                self._open.popitem(last=False)[1][0].close()
        else:
            self._open.move_to_end(path)
        return got


def decode_frames(containers: _Containers, path: str, timestamps: list[float], tolerance_s: float) -> torch.Tensor:
    """float32 (k, 3, h, w) in [0, 1]: the decoded frames nearest to `timestamps` (seconds in the file)."""
    container, stream = containers.get(path)
    first, last = min(timestamps), max(timestamps)
    container.seek(round(first / stream.time_base) - 1, backward=True, any_frame=False, stream=stream)
    frames, times = [], []
    for frame in container.decode(stream):
        if frame.pts is None:
            continue
        ts = float(frame.pts * stream.time_base)
        frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).contiguous())
        times.append(ts)
        if ts >= last:
            break
    if not frames:
        raise SourceDataError(f"{path}: no frame decoded in [{first}, {last}]")
    dist = torch.cdist(torch.tensor(timestamps, dtype=torch.float64)[:, None],
                       torch.tensor(times, dtype=torch.float64)[:, None], p=1)
    nearest, pick = dist.min(1)
    if not bool((nearest <= tolerance_s).all()):
        raise SourceDataError(f"{path}: queried {timestamps}, nearest decoded frames {nearest.tolist()} s away "
                              f"(tolerance {tolerance_s} s)")
    return torch.stack([frames[i] for i in pick.tolist()]).type(torch.float32) / 255


class LeRobotStyleDataset(torch.utils.data.Dataset):
    def __init__(self, root: str, *, delta_timestamps: dict | None = None, tolerance_s: float = 1e-4):
        meta, episodes = discover(str(root))
        if meta.image_keys:
            raise SourceDataError(f"{root}: image features; this baseline times video decoding")
        self.fps, self.tolerance_s = meta.fps, tolerance_s
        self.cameras = [c.key for c in meta.cameras]
        self.deltas = delta_indices(delta_timestamps or {}, meta.fps, tolerance_s)
        self.tasks = dict(meta.tasks)
        self.episodes = []
        for spec in episodes:
            table = read_table(spec)
            self.episodes.append({
                "episode": spec.index, "videos": dict(spec.videos),
                "from": dict(zip((k for k, _ in spec.videos), (s[0] for s in spec.spans))) if spec.spans else {},
                STATE_KEY: np.array(table.column(STATE_KEY).to_pylist(), np.float32),
                ACTION_KEY: np.array(table.column(ACTION_KEY).to_pylist(), np.float32),
                **{name: table.column(name).to_numpy() for name in ("timestamp", "frame_index", "index",
                                                                     "task_index")}})
        lengths = np.array([len(e["timestamp"]) for e in self.episodes], np.int64)
        self._to = np.cumsum(lengths)
        self._containers: _Containers | None = None

    def __getstate__(self):
        return {**self.__dict__, "_containers": None}  # open containers stay in their process

    def __len__(self) -> int:
        return int(self._to[-1])

    def __getitem__(self, idx: int) -> dict:
        if self._containers is None:
            self._containers = _Containers()
        k = int(np.searchsorted(self._to, idx, side="right"))
        ep = self.episodes[k]
        t = idx - int(self._to[k] - len(ep["timestamp"]))
        length = len(ep["timestamp"])
        item: dict = {}
        for key in (STATE_KEY, ACTION_KEY):
            rows, pad = query(self.deltas.get(key), t, length)
            values = ep[key][rows]
            item[key] = torch.from_numpy(values if key in self.deltas else values[0])
            if key in self.deltas:
                item[f"{key}_is_pad"] = torch.from_numpy(pad)
        for cam in self.cameras:
            rows, pad = query(self.deltas.get(cam), t, length)
            shift = ep["from"].get(cam, 0.0)
            timestamps = [shift + float(ep["timestamp"][r]) for r in rows.tolist()]
            frames = decode_frames(self._containers, ep["videos"][cam], timestamps, self.tolerance_s)
            item[cam] = frames.squeeze(0)  # lerobot's `frames.squeeze(0)`: one query -> (3, h, w)
            if cam in self.deltas:
                item[f"{cam}_is_pad"] = torch.from_numpy(pad)
        item["timestamp"] = torch.tensor(ep["timestamp"][t], dtype=torch.float32)
        for name in ("frame_index", "index", "task_index"):
            item[name] = torch.tensor(int(ep[name][t]), dtype=torch.int64)
        item["episode_index"] = torch.tensor(ep["episode"], dtype=torch.int64)
        item["task"] = self.tasks.get(int(ep["task_index"][t]), "")
        return item
