"""The loader GR00T and LeRobot users run today, rebuilt faithfully for timing.

A `torch.utils.data.Dataset` over the LeRobot v2.x dataset itself (mp4 +
parquet). Every item decodes its window's frames at train time, the way
LeRobot's `decode_video_frames_torchvision(backend="pyav")` (and GR00T's
`torchvision_av` backend) do it:

1. open the container (once per call and camera: neither library caches it),
2. seek to the nearest keyframe at or before the first requested timestamp
   (`keyframes_only=True`: PyAV has no accurate seek),
3. decode forward, converting EVERY decoded frame to RGB (torchvision's
   VideoReader yields `frame.to_rgb().to_ndarray()` for each frame), until a
   frame's pts reaches the last requested timestamp,
4. keep, per requested timestamp, the decoded frame nearest in pts, and fail
   if it is further than `tolerance_s` away (LeRobot asserts the same),
5. return float32 (K, 3, H, W) in [0, 1].

The tabular part (state/action) is read once per episode up front, which is
cheaper than LeRobot's per-item Arrow `select`; the baseline is timed at its
best, so any ratio against it is conservative.

Backend "pyav-threaded" is the same with FFmpeg's own threading switched on
(`stream.thread_type = "AUTO"`: frame + slice threads), the first thing a user
tuning the on-the-fly path would try.

The torchcodec backend mirrors LeRobot's `decode_video_frames_torchcodec`
(approximate seek mode, `get_frames_at(indices)`); `torchcodec_status()`
says why it cannot run when it cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loongforge.shared.errors import ConfigError, SourceDataError

BACKENDS = ("pyav", "pyav-threaded", "torchcodec")


@dataclass(frozen=True, slots=True)
class Window:
    """One training sample as LeRobot indexes it: timestep t of an episode, the frames its
    video delta timestamps show (clamped into the episode) and, from t, the action chunk."""

    episode: int  # the source's episode index
    t: int
    frames: tuple[int, ...]  # source frame indices shown, ascending (repeats where clamped)


def decode_frames_pyav(path: str, timestamps: list[float], tolerance_s: float, threaded: bool = False) -> np.ndarray:
    """uint8 (K, H, W, 3) RGB frames nearest to `timestamps` (seconds)."""
    loaded, loaded_ts = decode_span(path, min(timestamps), max(timestamps), threaded=threaded)
    return _nearest(path, loaded, loaded_ts, timestamps, tolerance_s)


def decode_span(path: str, first: float, last: float, threaded: bool = False) -> tuple[list[np.ndarray], list[float]]:
    """Every frame from the keyframe at or before `first` through the first frame
    at or after `last`, each converted to RGB, with its pts in seconds."""
    import av

    loaded, loaded_ts = [], []
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            if threaded:
                stream.thread_type = "AUTO"  # thread_count 0 = FFmpeg picks one per usable core
            # backward=True, any_frame=False: land on the keyframe at or before `first`.
            container.seek(int(first / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                ts = float(frame.pts * stream.time_base)
                loaded.append(frame.to_ndarray(format="rgb24"))
                loaded_ts.append(ts)
                if ts >= last:
                    break
    except av.FFmpegError as exc:
        raise SourceDataError(f"{path}: cannot decode ({exc})") from exc
    return loaded, loaded_ts


def _nearest(path, loaded, loaded_ts, timestamps, tolerance_s) -> np.ndarray:
    if not loaded:
        raise SourceDataError(f"{path}: no frame decoded for timestamps {timestamps}")
    dist = np.abs(np.asarray(timestamps)[:, None] - np.asarray(loaded_ts)[None, :])
    pick = dist.argmin(axis=1)
    worst = dist[np.arange(len(timestamps)), pick].max()
    if worst >= tolerance_s:
        raise SourceDataError(f"{path}: a requested timestamp is {worst:.4f}s from any decoded frame "
                              f"(tolerance {tolerance_s:.4f}s): video and parquet disagree")
    return np.stack([loaded[i] for i in pick])


def torchcodec_status() -> str | None:
    """None if torchcodec decodes on this machine, else the reason it cannot, with
    the innermost loader error (the missing library), not only the wrapper's."""
    try:
        from torchcodec.decoders import VideoDecoder  # noqa: F401
    except ImportError as exc:
        return (f"torchcodec not installed ({exc.name or exc}); every PyPI release for torch 2.13 is a CUDA "
                "build (0.17.0+cu130 needs libtorch_cuda.so, libnvrtc.so.13): see benchmarks/README.md")
    except Exception as exc:  # noqa: BLE001 - a wheel that imports but cannot load its libs lands here
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        first = str(exc).splitlines()[0][:160]
        cause = "" if root is exc else f": {type(root).__name__}: {str(root).splitlines()[0][:160]}"
        return f"torchcodec cannot load its libraries ({first}){cause}"
    return None


def decode_frames_torchcodec(path: str, timestamps: list[float], tolerance_s: float, fps: float) -> np.ndarray:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(path, device="cpu", seek_mode="approximate")
    indices = [int(round(t * fps)) for t in timestamps]
    batch = decoder.get_frames_at(indices=indices)
    loaded_ts = [float(t) for t in batch.pts_seconds]
    frames = batch.data.permute(0, 2, 3, 1).numpy()  # (K, C, H, W) -> (K, H, W, C)
    return _nearest(path, list(frames), loaded_ts, timestamps, tolerance_s)


class LeRobotVideoDataset:
    """Map-style dataset of `windows` over a LeRobot v2.x root (see module doc)."""

    def __init__(self, root: str | Path, windows: list[Window], *, action_horizon: int,
                 cameras: tuple[str, ...] | None = None, backend: str = "pyav", transform=None):
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: choose one of {BACKENDS}")
        self.root = Path(root)
        info = json.loads((self.root / "meta" / "info.json").read_text())
        self.fps = float(info["fps"])
        self.video_path = info["video_path"]
        self.chunks_size = int(info.get("chunks_size", 1000))
        keys = [k for k, f in info["features"].items() if f.get("dtype") == "video"]
        self.cameras = tuple(cameras) if cameras is not None else tuple(keys)
        self.windows = list(windows)
        self.action_horizon = action_horizon
        self.backend = backend
        # Per-item transform run in the worker, as GR00T's dataset applies its
        # transforms (normalization, tokenization) inside __getitem__.
        self.transform = transform
        # LeRobotDataset's default tolerance_s: decoded pts must match the parquet timestamps.
        self.tolerance_s = 1e-4
        self.tasks = {int(r["task_index"]): r["task"] for r in _jsonl(self.root / "meta" / "tasks.jsonl")}
        self._tables = self._load_tables(info, {w.episode for w in self.windows})

    def _load_tables(self, info: dict, episodes: set[int]) -> dict[int, dict[str, np.ndarray]]:
        import pyarrow.parquet as pq

        out = {}
        for ep in sorted(episodes):
            path = self.root / info["data_path"].format(episode_chunk=ep // self.chunks_size, episode_index=ep)
            table = pq.read_table(path, columns=["observation.state", "action", "task_index"])
            out[ep] = {
                "state": np.stack(table.column("observation.state").to_numpy(zero_copy_only=False)).astype(np.float32),
                "action": np.stack(table.column("action").to_numpy(zero_copy_only=False)).astype(np.float32),
                "task_index": table.column("task_index").to_numpy(),
            }
        return out

    def __len__(self) -> int:
        return len(self.windows)

    def video_file(self, episode: int, camera: str) -> str:
        rel = self.video_path.format(episode_chunk=episode // self.chunks_size, video_key=camera,
                                     episode_index=episode)
        return str(self.root / rel)

    def decode(self, episode: int, camera: str, timestamps: list[float]) -> np.ndarray:
        path = self.video_file(episode, camera)
        if self.backend == "torchcodec":
            return decode_frames_torchcodec(path, timestamps, self.tolerance_s, self.fps)
        return decode_frames_pyav(path, timestamps, self.tolerance_s, threaded=self.backend == "pyav-threaded")

    def __getitem__(self, i: int) -> dict:
        import torch

        w = self.windows[i]
        table = self._tables[w.episode]
        frames = np.asarray(w.frames)
        timestamps = [float(f) / self.fps for f in frames]
        item = {}
        for cam in self.cameras:
            rgb = self.decode(w.episode, cam, timestamps)
            item[cam] = torch.from_numpy(rgb).permute(0, 3, 1, 2).float().div_(255.0)
        n = len(table["state"])
        # Action chunk from t; indices past the episode end are clamped and flagged, as
        # LeRobot's delta_timestamps padding does.
        idx = w.t + np.arange(self.action_horizon)
        item["observation.state"] = torch.from_numpy(table["state"][frames])
        item["action"] = torch.from_numpy(table["action"][np.minimum(idx, n - 1)])
        item["action_is_pad"] = torch.from_numpy(idx >= n)
        item["task"] = self.tasks.get(int(table["task_index"][w.t]), "")
        return self.transform(item) if self.transform is not None else item


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_baseline_loader(dataset: LeRobotVideoDataset, *, batch_size: int, num_workers: int, seed: int = 0):
    """The DataLoader as LeRobot's train script builds it (shuffle, drop_last)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, drop_last=True,
        generator=generator, persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
    )
