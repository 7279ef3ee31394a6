"""The trainer's view of a format-2 root: what the model config, the loader and the
validation set need, in one object built once in preflight.

`load_training_data(cfg.data)` returns the v1 ShardIndex for a version-1 root (unchanged
path) and a `V2Data` for a version-2 root. V2Data carries the dataset's DatasetInfo with
the training-time sample shape filled in (frames per sample = len(video deltas), action
horizon = --action-horizon or the one preprocess recorded), so recipes.resolve builds the
model from it exactly as from a v1 index.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from loongforge.shared.errors import ConfigError
from loongforge.shared.index import DatasetInfo, load_index
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.fill import V2Filler, open_dataset_v2
from loongforge.train.data.loader import BlockLoader, root_format_version
from loongforge.train.data.samples import DeltaSpec, SampleTable
from loongforge.train.data.sources import SourceSpec


@dataclasses.dataclass(frozen=True)
class V2Data:
    root: str
    ds: object  # shared/dataset_v2.DatasetV2
    deltas: DeltaSpec
    dataset: DatasetInfo
    format_version: int = 2

    @property
    def max_frames(self) -> int:
        return self.deltas.frames

    @property
    def num_samples(self) -> int:
        """Samples at stride 1 (every timestep of every episode, the split included)."""
        return int(self.ds.num_frames)

    @property
    def val_episodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.ds.val_episodes))


def deltas_of(d, info: DatasetInfo) -> DeltaSpec:
    """The DeltaSpec of a DataConfig; horizon 0 = what preprocess recorded (GR00T: 16)."""
    horizon = d.action_horizon or info.action_horizon or 16
    return DeltaSpec(video=tuple(d.video_deltas), state=tuple(d.state_deltas), action_horizon=horizon,
                     action_pad=d.action_pad)


def load_training_data(d):
    """v1 ShardIndex, or V2Data for a format-2 root (FormatError/ConfigError on a bad root)."""
    if root_format_version(d.root) != 2:
        return load_index(d.root)  # v1, or its refusal of an unknown version with the hint
    ds = open_dataset_v2(d.root)  # the trainer's own reads (validation set) go to the origin
    deltas = deltas_of(d, ds.info)
    info = dataclasses.replace(ds.info, frames_per_sample=deltas.frames, action_horizon=deltas.action_horizon)
    return V2Data(d.root, ds, deltas, info)


def load_for_policy(root: str, sidecar: dict, action_horizon: int):
    """What Policy.load needs of the data root: the v1 index, or V2Data with the delta indices
    the run trained with (recorded in the checkpoint sidecar's "data")."""
    if root_format_version(root) != 2:
        return load_index(root)
    ds = open_dataset_v2(root)
    d = sidecar.get("data", {})
    deltas = DeltaSpec(video=tuple(d.get("video_deltas", (0,))), state=tuple(d.get("state_deltas", ())),
                       action_horizon=action_horizon, action_pad=d.get("action_pad", "last"))
    info = dataclasses.replace(ds.info, frames_per_sample=deltas.frames, action_horizon=action_horizon)
    return V2Data(root, ds, deltas, info)


def make_loader(d, data: V2Data, *, batch_size: int, rank: int, world: int, device) -> BlockLoader:
    return BlockLoader(d.root, dataset=data.ds, batch_size=batch_size, num_workers=d.num_workers, seed=d.seed,
                       rank=rank, world=world, device=device, deltas=data.deltas, stride=d.sample_stride,
                       block_run=d.block_run, block_window=d.block_window, block_cache_mb=d.block_cache_mb,
                       max_text_tokens=d.max_text_tokens, bad_samples=d.bad_samples, prefetch=d.prefetch_batches,
                       timeout_s=d.worker_timeout_s, start_method=d.start_method, image_mean=d.image_mean,
                       image_std=d.image_std,
                       source=SourceSpec(root=d.root, cache_socket=d.cache_socket, cache_tcp=d.cache_tcp))


def val_ids(data: V2Data, limit: int, stride: int = 1) -> np.ndarray:
    """Sample ids (stride-1 numbering) of the held-out episodes, every `stride`-th t, evenly
    thinned to `limit`: the fixed subset --eval-every scores."""
    table = SampleTable(np.asarray(data.ds.episode_lengths))
    val = np.asarray(data.ds.val_mask, bool)
    if not val.any():
        raise ConfigError("the index has no validation split; re-run preprocess with --val-episodes 10%")
    ids = np.flatnonzero(table.keep_mask(val))
    ids = ids[table.locate(ids)[1] % stride == 0]
    if limit and len(ids) > limit:
        ids = ids[np.linspace(0, len(ids) - 1, limit).round().astype(np.int64)]
    return ids


def chunk_ids(data: V2Data, episode_id: int) -> np.ndarray:
    """Open-loop eval (openloop.py) of one episode: samples t = 0, H, 2H, ... so the predicted
    chunks tile its timeline. Empty when the episode is not in the root."""
    rows = np.flatnonzero(np.asarray(data.ds.tables["episode_id"]) == episode_id)
    if not len(rows):
        return np.zeros(0, np.int64)
    table = SampleTable(np.asarray(data.ds.episode_lengths))
    row = int(rows[0])
    ts = np.arange(0, int(table.lengths[row]), data.deltas.action_horizon)
    return table.starts[row] + ts


class ValSetV2:
    """evaluate.ValSet for a v2 root: chosen samples (stride-1 ids), decoded once into device batches."""

    def __init__(self, data: V2Data, ids: np.ndarray, *, batch_size: int = 8, text_len: int = 32,
                 device="cpu", image_mean: float = 0.5, image_std: float = 0.25):
        ds, info = data.ds, data.dataset
        table = SampleTable(np.asarray(ds.episode_lengths))
        ids = np.asarray(ids, np.int64)
        self.ids, self.device = ids, torch.device(device)
        conv = dict(matrix=info.color_matrix, color_range=info.color_range, mean=image_mean, std=image_std)
        self.batches = []
        for start in range(0, len(ids), batch_size):
            chunk = ids[start:start + batch_size]
            layout = BatchLayout(len(chunk), tuple(info.slots), info.height, info.width, data.deltas.frames,
                                 info.state_dim, info.action_dim, data.deltas.action_horizon, text_len)
            arrays = layout.views(bytearray(layout.nbytes), data.deltas.frames)
            eps, ts = table.locate(chunk)
            V2Filler(ds, data.deltas, layout, 0).fill(arrays, list(zip(chunk.tolist(), eps.tolist(), ts.tolist())),
                                                      "raise")
            out = {n: torch.from_numpy(a.copy()).to(self.device) for n, a in arrays.items()
                   if not n.startswith("frames.")}
            out["frames"] = {s: nv12_to_input(torch.from_numpy(arrays[f"frames.{s}"].copy()).to(self.device), **conv)
                             for s in layout.slots}
            self.batches.append(out)
