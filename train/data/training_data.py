"""The trainer's view of a shard root: what the model config, the loader and the
validation set need, in one object built once in preflight.

`load_training_data(cfg.data)` opens the root (shared/dataset.py: a root of the retired
format 1 is refused there with the `loongforge convert` hint) and returns a `TrainingData`
carrying the dataset's DatasetInfo with the training-time sample shape filled in (frames
per sample = len(video deltas), action horizon = --action-horizon or the one preprocess
recorded), so train/recipes.py plans the model from it.
"""

from __future__ import annotations

import dataclasses

from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import DatasetInfo
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.data.sources import SourceSpec


@dataclasses.dataclass(frozen=True)
class TrainingData:
    root: str
    ds: Dataset
    deltas: DeltaSpec
    dataset: DatasetInfo  # the root's, with frames_per_sample and action_horizon of this run

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


def _training_data(root: str, deltas: DeltaSpec, ds: Dataset) -> TrainingData:
    if not ds.info.uniform_size:
        sizes = ", ".join(f"{c.slot} {ds.info.camera_size(i)[0]}x{ds.info.camera_size(i)[1]}"
                          for i, c in enumerate(ds.info.cameras))
        raise ConfigError(f"{root}: cameras are stored at different sizes ({sizes}); the model takes one image "
                          "size: re-run `loongforge preprocess` with --height H --width W")
    info = dataclasses.replace(ds.info, frames_per_sample=deltas.frames, action_horizon=deltas.action_horizon)
    return TrainingData(root, ds, deltas, info)


def load_training_data(d) -> TrainingData:
    """The root of a DataConfig (FormatError/ConfigError on a bad root)."""
    ds = open_root(d.root)  # the trainer's own reads (validation set) go to the origin
    return _training_data(d.root, deltas_of(d, ds.info), ds)


def load_for_policy(root: str, sidecar: dict, action_horizon: int) -> TrainingData:
    """What Policy.load needs of the data root, with the delta indices the run trained with
    (recorded in the checkpoint sidecar's "data")."""
    d = sidecar.get("data", {})
    deltas = DeltaSpec(video=tuple(d.get("video_deltas", (0,))), state=tuple(d.get("state_deltas", ())),
                       action_horizon=action_horizon, action_pad=d.get("action_pad", "last"))
    return _training_data(root, deltas, open_root(root))


def make_loader(d, data: TrainingData, *, batch_size: int, rank: int, world: int, device, prompts=None,
                image_mean: float = 0.5, image_std: float = 0.5) -> BlockLoader:
    return BlockLoader(d.root, dataset=data.ds, batch_size=batch_size, num_workers=d.num_workers, seed=d.seed,
                       rank=rank, world=world, device=device, deltas=data.deltas, stride=d.sample_stride,
                       block_run=d.block_run, block_window=d.block_window, block_cache_mb=d.block_cache_mb,
                       bad_samples=d.bad_samples, prefetch=d.prefetch_batches, timeout_s=d.worker_timeout_s,
                       start_method=d.start_method, image_mean=image_mean, image_std=image_std, prompts=prompts,
                       source=SourceSpec(root=d.root, cache_socket=d.cache_socket, cache_tcp=d.cache_tcp))
