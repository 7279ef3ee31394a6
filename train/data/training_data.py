"""The trainer's view of its shard roots: what the model config, the processor, the loader and the
validation set need, in one object built once in preflight.

`load_training_data(cfg.data)` opens each root (shared/dataset.py: a root of the retired format 1 is
refused there with the `loongforge convert` hint) and returns a `TrainingData`: per root its
embodiment (the tag, modality config, key layout and statistics preprocess recorded), the sample
shape that config gives (video and state delta indices, the action horizon; the --video-deltas /
--state-deltas / --action-horizon flags override it where the statistics allow) and its mixture
weight. The first root's fields are the object's own (most runs train one root).
"""

from __future__ import annotations

import dataclasses

from loongforge.shared import statistics
from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.embodiment import EmbodimentConfig
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import DatasetInfo
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.mixture import MixtureLoader
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.data.sources import SourceSpec
from loongforge.train.data.state_action import root_embodiment


@dataclasses.dataclass(frozen=True)
class RootData:
    root: str
    ds: Dataset
    deltas: DeltaSpec
    dataset: DatasetInfo  # the root's, with frames_per_sample and action_horizon of this run
    tag: str
    config: EmbodimentConfig  # the run's (delta indices as the flags leave them)
    keys: dict  # where each key lives in the root (shared/embodiment.key_layout)
    statistics: dict  # the root's own, per key
    weight: float = 1.0

    @property
    def cameras(self) -> tuple[str, ...]:
        """Camera slots in the modality config's video order (the order of the model's images)."""
        return tuple(self.keys["video"][k] for k in self.config.video.modality_keys)


@dataclasses.dataclass(frozen=True)
class TrainingData:
    roots: tuple[RootData, ...]

    # the first root's, for the many places that train one
    @property
    def root(self) -> str:
        return self.roots[0].root

    @property
    def ds(self) -> Dataset:
        return self.roots[0].ds

    @property
    def deltas(self) -> DeltaSpec:
        return self.roots[0].deltas

    @property
    def dataset(self) -> DatasetInfo:
        return self.roots[0].dataset

    @property
    def max_frames(self) -> int:
        return max(r.deltas.frames for r in self.roots)

    @property
    def num_samples(self) -> int:
        """Frames of the first root (every timestep of every episode, the split included)."""
        return int(self.ds.num_frames)

    @property
    def val_episodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.ds.val_episodes))

    def embodiment_statistics(self) -> dict:
        """{tag: statistics}: each tag's roots merged with their mixture weights (Isaac-GR00T's rule)."""
        by_tag: dict[str, list[RootData]] = {}
        for r in self.roots:
            by_tag.setdefault(r.tag, []).append(r)
        return {t: statistics.merge_embodiment([r.statistics for r in rs], [r.weight for r in rs])
                for t, rs in by_tag.items()}

    def configs(self) -> dict:
        """{tag: the run's modality config}; roots of one tag must agree."""
        out: dict = {}
        for r in self.roots:
            if out.setdefault(r.tag, r.config) != r.config:
                raise ConfigError(f"roots of embodiment {r.tag} record different modality configs ({r.root}); "
                                  "re-run preprocess with one --modality-config")
        return out


def run_config(config: EmbodimentConfig, d, has_relative: bool, root: str) -> EmbodimentConfig:
    """The root's config with the flags' delta indices (a DataConfig's video/state deltas, horizon)."""
    video, state = config.video, config.state
    if d.video_deltas and tuple(d.video_deltas) != (0,) or d.state_deltas:
        vd = tuple(d.video_deltas) or video.delta_indices
        DeltaSpec(video=vd, state=tuple(d.state_deltas))  # the flags' own checks first (data.video_deltas: ...)
        video = dataclasses.replace(video, delta_indices=vd)
        state = dataclasses.replace(state, delta_indices=tuple(d.state_deltas) or vd)
    action = config.action
    if d.action_horizon and d.action_horizon != config.horizon:
        if has_relative:
            raise ConfigError(f"--action-horizon {d.action_horizon}: {root} was preprocessed with a {config.horizon}-"
                              "step horizon and relative actions, whose statistics are per step; re-run preprocess "
                              "with that horizon in the modality config")
        action = dataclasses.replace(action, delta_indices=tuple(range(d.action_horizon)))
    try:
        return dataclasses.replace(config, video=video, state=state, action=action)
    except ConfigError as exc:
        raise ConfigError(f"{root}: {exc}") from None


def deltas_of(config: EmbodimentConfig, action_pad: str) -> DeltaSpec:
    h = config.action.delta_indices
    if h[0] != 0:
        raise ConfigError(f"action delta_indices {list(h)}: the chunk must start at the current frame (0)")
    return DeltaSpec(video=tuple(config.video.delta_indices), state=tuple(config.state.delta_indices),
                     action_horizon=len(h), action_pad=action_pad)


def root_data(root: str, d, weight: float = 1.0, ds: Dataset | None = None) -> RootData:
    ds = ds or open_root(root)  # the trainer's own reads (validation set) go to the origin
    found = root_embodiment(ds.info, ds)
    relative = any(found.config.action.action_config(k).relative for k in found.config.action.modality_keys)
    config = run_config(found.config, d, relative, root)
    deltas = deltas_of(config, d.action_pad)
    info = dataclasses.replace(ds.info, frames_per_sample=deltas.frames, action_horizon=deltas.action_horizon)
    return RootData(root, ds, deltas, info, found.tag, config, found.layout, found.statistics, weight)


def load_training_data(d) -> TrainingData:
    """The roots of a DataConfig (FormatError/ConfigError on a bad root), with their mixture ratios."""
    roots = d.mixture or ((d.root, 1.0),)
    return TrainingData(tuple(root_data(root, d, weight) for root, weight in roots))


def load_for_policy(root: str, sidecar: dict, action_horizon: int) -> TrainingData:
    """The root a run trained on, with the delta indices it trained with (the checkpoint sidecar's "data")."""
    d = sidecar.get("data", {})
    view = _DeltaFlags(tuple(d.get("video_deltas", (0,))), tuple(d.get("state_deltas", ())),
                       int(d.get("action_horizon", 0) or 0), d.get("action_pad", "none"))
    return TrainingData((root_data(root, view),))


@dataclasses.dataclass(frozen=True)
class _DeltaFlags:
    video_deltas: tuple
    state_deltas: tuple
    action_horizon: int
    action_pad: str


def make_loader(d, data: TrainingData, *, batch_size: int, rank: int, world: int, device, processor=None,
                prompts=None, image_mean: float = 0.5, image_std: float = 0.5, step_batch: int | None = None):
    """The run's loader: a BlockLoader over its root, or a MixtureLoader over one per root.
    `prompts`: the PromptTable of each root (one table, or a sequence of them). `step_batch`: the optimizer
    step's global batch when `batch_size` is one micro-batch of it (order.plan_epoch)."""
    tables = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts] * len(data.roots)
    loaders = []
    for r, table in zip(data.roots, tables):
        sa = processor.state_action(r.tag) if processor is not None else None
        loaders.append(BlockLoader(
            r.root, dataset=r.ds, batch_size=batch_size, num_workers=d.num_workers, seed=d.seed, rank=rank,
            world=world, device=device, deltas=r.deltas, stride=d.sample_stride, block_run=d.block_run,
            block_window=d.block_window, block_cache_mb=d.block_cache_mb, bad_samples=d.bad_samples,
            prefetch=d.prefetch_batches, timeout_s=d.worker_timeout_s, start_method=d.start_method,
            image_mean=image_mean, image_std=image_std, prompts=table,
            source=SourceSpec(root=r.root, cache_socket=d.cache_socket, cache_tcp=d.cache_tcp),
            state_action=sa, keys=r.keys, cameras=r.cameras, step_batch=step_batch))
    if len(loaders) == 1:
        return loaders[0]
    return MixtureLoader(loaders, [r.weight for r in data.roots], seed=d.seed)

