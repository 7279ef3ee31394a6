"""`LeRobotDataset`: a drop-in for LeRobot's dataset class, over a LoongForge shard root.

    from loongforge.train.data.lerobot import LeRobotDataset
    ds = LeRobotDataset("shards/", delta_timestamps={"observation.images.front": [-0.1, 0.0],
                                                     "action": [i / 20 for i in range(16)]})
    ds[0]                 # LeRobot's item dict: same keys, shapes, dtypes, padding (lerobot_items.py)
    len(ds), ds.num_episodes, ds.episode_data_index, ds.meta.stats, ds.meta.features, ds.fps
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=4)

The training loop a user already runs (lerobot-train, GR00T's trainer, plain PyTorch) keeps its
DataLoader; items come from the shards (decompress, no video decoding). For the same items at
LoongForge's speed (deterministic global order, block cache, decode worker pool, batches put on
the GPU by the prefetcher), use `LeRobotLoader` (lerobot_loader.py).

Episodes: those of the root's training split by default (every episode when preprocess held
none out), `split="all"` for every one, `split="val"` for the held-out ones, or an explicit list
of source episode ids (`episodes=[0, 3]`, as LeRobot's argument). `episode_data_index`
({"from", "to"}, int64) gives each episode's [from, to) in this dataset's index space, as
LeRobot < 0.4 exposed it; `meta.episodes` the v3.0 form (dataset_from_index/dataset_to_index).

Stats (`meta.stats`, LeRobot's layout {feature: {"mean", "std", "min", "max", ...: ndarray}}):
the source dataset's own (stats.json, or v2.1's episodes_stats aggregated), what LeRobot's
normaliser would be built from; roots without them fall back to LoongForge's state/action stats
(over the training episodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import DatasetInfo
from loongforge.train.data.lerobot_items import ACTION_KEY, STATE_KEY, ItemPlan, ItemReader, PyAVRGB, float_rgb, query

SPLITS = ("train", "val", "all")
DEFAULT_CACHE_MB = 64


@dataclass(frozen=True)
class LeRobotMeta:
    """The parts of LeRobot's LeRobotDatasetMetadata a policy factory and a training loop read."""

    fps: float
    features: dict
    stats: dict
    tasks: dict  # task_index -> instruction
    episodes: dict  # episode_index, length, dataset_from_index, dataset_to_index: lists (v3.0's meta.episodes)
    robot_type: str = ""
    camera_keys: tuple[str, ...] = field(default=())
    video_keys: tuple[str, ...] = field(default=())
    image_keys: tuple[str, ...] = field(default=())

    @property
    def total_episodes(self) -> int:
        return len(self.episodes["episode_index"])

    @property
    def total_frames(self) -> int:
        return int(sum(self.episodes["length"]))


def lerobot_features(info: DatasetInfo) -> dict:
    """info.json's features as preprocess found them, or the equivalent for a root without them."""
    found = info.source.get("features")
    if found:
        return found
    feats = {c.key: {"dtype": "video", "shape": [*info.camera_size(i), 3], "names": ["height", "width", "channels"]}
             for i, c in enumerate(info.cameras)}
    feats[STATE_KEY] = {"dtype": "float32", "shape": [info.state_dim], "names": list(info.state_names) or None}
    feats[ACTION_KEY] = {"dtype": "float32", "shape": [info.action_dim], "names": list(info.action_names) or None}
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("task_index", "int64")):
        feats[name] = {"dtype": dtype, "shape": [1], "names": None}
    return feats


def lerobot_stats(info: DatasetInfo) -> dict:
    """{feature: {stat: ndarray}}: the source's LeRobot statistics, else LoongForge's state/action ones."""
    found = info.source.get("lerobot_stats") or {}
    if not found:
        found = {key: info.stats[name] for key, name in ((STATE_KEY, "state"), (ACTION_KEY, "action"))
                 if name in info.stats}
    return {key: {stat: np.asarray(v) for stat, v in d.items()} for key, d in found.items() if isinstance(d, dict)}


def select_episodes(ds: Dataset, split: str, episodes) -> np.ndarray:
    """Episode rows of the root, in index order: an explicit list of source ids, or a split."""
    ids = np.asarray(ds.tables["episode_id"])
    if episodes is not None:
        want = [int(e) for e in episodes]
        missing = sorted(set(want) - set(ids.tolist()))
        if missing:
            raise ConfigError(f"episodes {missing}: not in this root (it has {len(ids)}: {ids[:8].tolist()}...)")
        return np.flatnonzero(np.isin(ids, want))
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: choose one of {SPLITS}")
    val = np.asarray(ds.val_mask, bool)
    keep = {"all": np.ones_like(val), "train": ~val, "val": val}[split]
    return np.flatnonzero(keep)


class LeRobotDataset(torch.utils.data.Dataset):
    def __init__(self, root: str, *, delta_timestamps: dict | None = None, episodes=None, split: str = "train",
                 color: str = "loongforge", tolerance_s: float = 1e-4, block_cache_mb: float = DEFAULT_CACHE_MB,
                 dataset: Dataset | None = None):
        self.root = root
        self.ds = dataset if dataset is not None else open_root(root)
        info = self.ds.info
        self.delta_timestamps = delta_timestamps
        self.plan = ItemPlan.build(info, delta_timestamps, tolerance_s=tolerance_s, color=color)
        self.rows = select_episodes(self.ds, split, episodes)
        lengths = np.asarray(self.ds.episode_lengths)[self.rows].astype(np.int64)
        self._to = np.cumsum(lengths)
        self._from = self._to - lengths
        self.cache_bytes = int(block_cache_mb * (1 << 20))
        self.tasks = {int(k): v for k, v in (info.tasks or {}).items()}
        ids = [int(self.ds.episode_id(e)) for e in self.rows]
        self.meta = LeRobotMeta(
            fps=info.fps, features=lerobot_features(info), stats=lerobot_stats(info), tasks=self.tasks,
            episodes={"episode_index": ids, "length": lengths.tolist(), "dataset_from_index": self._from.tolist(),
                      "dataset_to_index": self._to.tolist()},
            robot_type=str(info.source.get("robot_type") or ""), camera_keys=tuple(c.key for c in self.plan.cameras),
            video_keys=tuple(c.key for c in self.plan.cameras if c.kind == "video"),
            image_keys=tuple(c.key for c in self.plan.cameras if c.kind == "image"))
        self._reader: ItemReader | None = None  # per process: made on first use (DataLoader workers too)
        self._pyav: PyAVRGB | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"], state["_pyav"] = None, None  # caches and swscale contexts stay in their process
        return state

    # -- LeRobotDataset's surface ------------------------------------------------
    def __len__(self) -> int:
        return int(self._to[-1]) if len(self._to) else 0

    @property
    def num_frames(self) -> int:
        return len(self)

    @property
    def num_episodes(self) -> int:
        return len(self.rows)

    @property
    def fps(self) -> float:
        return self.meta.fps

    @property
    def features(self) -> dict:
        return self.meta.features

    @property
    def episode_data_index(self) -> dict[str, torch.Tensor]:
        return {"from": torch.from_numpy(self._from.copy()), "to": torch.from_numpy(self._to.copy())}

    # -- items ---------------------------------------------------------------------
    def locate(self, idx: int) -> tuple[int, int]:
        """Dataset index -> (episode row in the root, frame in the episode)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"index {idx} out of range for {n} frames")
        k = int(np.searchsorted(self._to, idx, side="right"))
        return int(self.rows[k]), idx - int(self._from[k])

    def __getitem__(self, idx: int) -> dict:
        if self._reader is None:
            self._reader = ItemReader(self.ds, self.cache_bytes)
        reader, plan = self._reader, self.plan
        e, t = self.locate(int(idx))
        arrays, length = reader.arrays(e), int(self.ds.episode_lengths[e])
        item: dict = {}
        for col in plan.columns:
            rows, pad = query(col.deltas, t, length)
            values = reader.column(e, col, rows, arrays)
            if col.dtype == "str":
                item[col.key] = str(values[0])
            else:
                item[col.key] = torch.from_numpy(values if col.deltas is not None else np.array(values[0]))
            if col.deltas is not None:
                item[f"{col.key}_is_pad"] = torch.from_numpy(pad)
        for cam in plan.cameras:
            rows, pad = query(cam.deltas, t, length)
            if plan.color == "pyav" and self._pyav is None:
                self._pyav = PyAVRGB()
            rgb = float_rgb(reader.frames(e, cam.column, rows), cam, plan, self._pyav)
            item[cam.key] = rgb[0] if cam.squeeze else rgb
            if cam.deltas is not None:
                item[f"{cam.key}_is_pad"] = torch.from_numpy(pad)
        # LeRobot's `meta.tasks.iloc[task_index]`: the instruction of the row's own task_index column.
        item["task"] = self.tasks.get(int(arrays[plan.task_array][t]), "")
        return item

    def __repr__(self) -> str:
        return (f"LeRobotDataset(root={self.root!r}, episodes={self.num_episodes}, frames={len(self)}, "
                f"fps={self.fps:g}, cameras={list(self.meta.camera_keys)})")
