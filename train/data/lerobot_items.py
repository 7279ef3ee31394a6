"""LeRobot's item semantics over a shard root: what `LeRobotDataset(root, delta_timestamps=...)[i]`
returns, shared by the map-style adapter (lerobot.py) and the fast path (lerobot_loader.py).

For global index i in episode e at frame t (length T) and a key with delta indices d (delta
timestamps x fps, each within `tolerance_s` of a whole frame, else refused as LeRobot does):

    rows   clamp(t + d, 0, T - 1)              frames / state rows / action rows read
    pad    (t + d < 0) | (t + d >= T)          `<key>_is_pad`, only for keys given a delta

Keys: every column of the source's data parquet that LeRobot's item holds (its info.json
non-camera features: observation.state, action, timestamp, episode_index, index, task_index, and
frame_index, next.done, next.reward, annotation.* where the dataset has them; the index's
`source.columns`, preprocess/lerobot/meta.py), each camera, `<key>_is_pad` for each key given
deltas, and `task` (the instruction of the row's `task_index` column). A root written before
`source.columns` gives state, action, timestamp, frame_index, episode_index, index, task_index.

Shapes and dtypes (LeRobot's, which builds each value with `torch.tensor`): a column with deltas
is (len(d), *shape), without it is the row's shape (a scalar for a shape-[1] feature); floats
are float32, integers int64, bools bool, strings str. A camera is (len(d), 3, h, w) float32 in
[0, 1], except a video camera with one delta or none, which is squeezed to (3, h, w) (LeRobot's
`frames.squeeze(0)`), and an image camera without deltas (3, h, w).

Colour: "loongforge" converts the stored NV12 with the index's matrix and range
(shared/color.py's rule, the trainer's numba pass), within a few LSB of PyAV; "pyav" rebuilds
the source's yuv420p planes and converts them with PyAV's own swscale call, bit-identical to
the RGB LeRobot's pyav backend returns for video (train/README.md has the measured difference
and cost). Image features always use "loongforge": their NV12 was made from the PNG's RGB by
the inverse rule (preprocess/stages/images.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from loongforge.shared.dataset import Dataset
from loongforge.shared.errors import ConfigError, FormatError
from loongforge.shared.index import DatasetInfo
from loongforge.train.data.block_cache import BlockCache
from loongforge.train.data.colorspace import nv12_to_input

STATE_KEY, ACTION_KEY = "observation.state", "action"
COLOR_MODES = ("loongforge", "pyav")
ARRAYS_KEPT = 64  # episodes whose per-frame arrays a reader keeps (a few KB each)


@dataclass(frozen=True, slots=True)
class CameraPlan:
    key: str  # observation.images.front
    column: int  # camera number in the index
    kind: str  # "video" | "image" (the source feature's dtype)
    deltas: tuple[int, ...] | None  # frame offsets; None: the current frame, no `_is_pad`
    height: int
    width: int

    @property
    def frames(self) -> int:
        return len(self.deltas) if self.deltas is not None else 1

    @property
    def squeeze(self) -> bool:
        """LeRobot drops the time axis of a video key with one delta (or none) and of an image key without."""
        return self.deltas is None or (self.kind == "video" and len(self.deltas) == 1)


@dataclass(frozen=True, slots=True)
class ColumnPlan:
    key: str  # observation.state | action | timestamp | next.done | ...
    array: str  # the episode array holding it; "" = episode_index (the episode's id)
    deltas: tuple[int, ...] | None
    shape: tuple[int, ...]  # one row's
    dtype: str  # float32 | int64 | bool | str (LeRobot's item dtype)

    @property
    def frames(self) -> int:
        return len(self.deltas) if self.deltas is not None else 1


def item_columns(info: DatasetInfo) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(key, array, shape, dtype) of every column of the item: the root's `source.columns`, or the
    fixed set of a root written before it."""
    found = info.source.get("columns")
    if found:
        return [(key, c["array"], tuple(c["shape"]), c["dtype"]) for key, c in found.items()]
    return [(STATE_KEY, "state", (info.state_dim,), "float32"), (ACTION_KEY, "action", (info.action_dim,), "float32"),
            ("timestamp", "timestamp", (), "float32"), ("frame_index", "frame_index", (), "int64"),
            ("episode_index", "", (), "int64"), ("index", "index", (), "int64"),
            ("task_index", "task_index", (), "int64")]


@dataclass(frozen=True, slots=True)
class ItemPlan:
    fps: float
    cameras: tuple[CameraPlan, ...]
    columns: tuple[ColumnPlan, ...]
    matrix: str
    color_range: str
    color: str = "loongforge"
    task_array: str = "task_index"  # the array of LeRobot's task_index column: what `task` is looked up by

    def __post_init__(self):
        if self.color not in COLOR_MODES:
            raise ConfigError(f"color={self.color!r}: choose one of {COLOR_MODES}")

    @classmethod
    def build(cls, info: DatasetInfo, delta_timestamps: dict | None, *, tolerance_s: float = 1e-4,
              color: str = "loongforge") -> "ItemPlan":
        deltas = delta_indices(delta_timestamps or {}, info.fps, tolerance_s)
        features = info.source.get("features") or {}
        columns = item_columns(info)
        known = [c.key for c in info.cameras] + [key for key, *_ in columns]
        unknown = sorted(set(deltas) - set(known))
        if unknown:
            raise ConfigError(f"delta_timestamps keys {unknown}: not in this root (it has {known})")
        strings = sorted(key for key, _, _, dtype in columns if dtype == "str" and key in deltas)
        if strings:
            raise ConfigError(f"delta_timestamps keys {strings}: string columns have no time axis (LeRobot cannot "
                              "stack them either)")
        cams = tuple(CameraPlan(c.key, i, (features.get(c.key) or {}).get("dtype", "video"), deltas.get(c.key),
                                *info.camera_size(i)) for i, c in enumerate(info.cameras))
        cols = tuple(ColumnPlan(key, array, deltas.get(key), shape, dtype) for key, array, shape, dtype in columns)
        task = next((c.array for c in cols if c.key == "task_index" and c.array), "task_index")
        return cls(info.fps, cams, cols, info.color_matrix, info.color_range, color, task)

    def key_deltas(self) -> dict:
        """{key: delta indices} of the keys given deltas (what resuming checks against)."""
        return {p.key: list(p.deltas) for p in (*self.cameras, *self.columns) if p.deltas is not None}


def delta_indices(delta_timestamps: dict, fps: float, tolerance_s: float) -> dict[str, tuple[int, ...]]:
    """LeRobot's check_delta_timestamps + get_delta_indices: each delta must be a whole number of
    frames (within tolerance_s); returns {key: round(delta * fps) per delta}."""
    out = {}
    for key, values in delta_timestamps.items():
        values = [float(v) for v in values]
        off = [v for v in values if abs(v * fps - round(v * fps)) / fps > tolerance_s]
        if off or not values:
            raise ConfigError(f"delta_timestamps[{key!r}] = {values}: every delta must be a multiple of 1/fps "
                              f"(fps {fps:g}, tolerance {tolerance_s} s){'; off: ' + str(off) if off else ''}")
        out[key] = tuple(int(round(v * fps)) for v in values)
    return out


def query(deltas: tuple[int, ...] | None, t: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows clamped into the episode, pad flags) of frame t's deltas (None: the frame itself)."""
    want = t + np.asarray(deltas if deltas is not None else (0,), np.int64)
    return np.clip(want, 0, length - 1), (want < 0) | (want >= length)


class PyAVRGB:
    """NV12 -> uint8 RGB through PyAV's own swscale call on the source's yuv420p planes: one
    reused frame and reformatter per size, so the result equals `frame.to_ndarray(format="rgb24")`
    of the decoded source frame (the RGB LeRobot's pyav backend returns)."""

    _RANGE = {"limited": 1, "full": 2}  # FFmpeg's AVColorRange: MPEG, JPEG
    _SPACE = {"bt601": 2, "bt709": 1}  # AVColorSpace: unspecified (swscale's BT.601 default), BT.709

    def __init__(self):
        from av.video.reformatter import VideoReformatter

        self.reformatter = VideoReformatter()
        self.frames: dict = {}

    def __call__(self, nv12: np.ndarray, matrix: str, color_range: str) -> np.ndarray:
        import av

        n, rows, w = nv12.shape
        h = rows * 2 // 3
        frame = self.frames.get((h, w, matrix, color_range))
        if frame is None:
            frame = av.VideoFrame(w, h, "yuv420p")
            frame.color_range, frame.colorspace = self._RANGE[color_range], self._SPACE[matrix]
            self.frames[(h, w, matrix, color_range)] = frame
        out = np.empty((n, h, w, 3), np.uint8)
        planes = [np.frombuffer(p, np.uint8).reshape(p.height, p.line_size) for p in frame.planes]
        for i in range(n):
            planes[0][:, :w] = nv12[i, :h]
            planes[1][:, : w // 2] = nv12[i, h:, 0::2]
            planes[2][:, : w // 2] = nv12[i, h:, 1::2]
            out[i] = self.reformatter.reformat(frame, format="rgb24").to_ndarray()
        return out


def float_rgb(nv12: np.ndarray, cam: CameraPlan, plan: ItemPlan, pyav: PyAVRGB | None) -> torch.Tensor:
    """(k, 3h/2, w) uint8 NV12 -> (k, 3, h, w) float32 in [0, 1] by the plan's colour mode."""
    if plan.color == "pyav" and cam.kind == "video":
        rgb = torch.from_numpy((pyav or PyAVRGB())(nv12, plan.matrix, plan.color_range))
        return rgb.permute(0, 3, 1, 2).float().div_(255)
    return nv12_to_input(torch.from_numpy(np.ascontiguousarray(nv12)), plan.matrix, plan.color_range, mean=0.0,
                         std=1.0)


class ItemReader:
    """One process's reads of a root: decoded blocks through a byte-bounded LRU, episode arrays
    through a small one."""

    def __init__(self, ds: Dataset, cache_bytes: int):
        self.ds, self.cache = ds, BlockCache(cache_bytes)
        self._arrays: OrderedDict[int, dict] = OrderedDict()

    def arrays(self, e: int) -> dict:
        got = self._arrays.get(e)
        if got is None:
            got = self.ds.read_arrays(e)
            length = int(self.ds.episode_lengths[e])
            for name in ("state", "action", "timestamp", *(k for k in got if k.startswith("col_"))):
                if got[name].shape[0] != length:
                    raise FormatError(f"episode {self.ds.episode_id(e)}: {name} has {got[name].shape[0]} rows, "
                                      f"the index says {length} frames")
            self._arrays[e] = got
            if len(self._arrays) > ARRAYS_KEPT:
                self._arrays.popitem(last=False)
        else:
            self._arrays.move_to_end(e)
        return got

    def frames(self, e: int, column: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """NV12 frames `rows` of episode row e's camera `column`, (k, 3h/2, w) uint8."""
        if out is None:
            out = np.empty((len(rows), *self.ds.frame_shape(column)), np.uint8)
        for k, f in enumerate(rows.tolist()):
            b, i = self.ds.block_of(f)
            block = self.cache.get((e, column, b), lambda bb=b: self.ds.read_block(e, column, bb))
            if i >= len(block):
                raise FormatError(f"episode {self.ds.episode_id(e)} camera {column}: block {b} has {len(block)} "
                                  f"frames, frame {f} needed")
            out[k] = block[i]
        return out

    def column(self, e: int, col: ColumnPlan, rows: np.ndarray, arrays: dict) -> np.ndarray:
        """(k, *shape) values of one column at episode rows `rows`, in the item's dtype."""
        if not col.array:
            values = np.full(len(rows), self.ds.episode_id(e), np.int64)
        elif col.array == "index" and "index" not in arrays:  # a source without LeRobot's index column
            values = int(self.ds.episode_starts[e]) + rows
        else:
            values = arrays[col.array][rows]
        return values if col.dtype == "str" else values.astype(col.dtype, copy=False)
