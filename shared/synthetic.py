"""Small valid shard roots made without video or Beam (tests, benchmarks, `tune`).

Frames are smooth, moving gradients (compressible like video, unlike noise)
with the frame number written into the first luma byte, so a loader test can
check which frame it got. The content is a learnable toy task: the state drifts
slowly, and the action is a fixed linear function of the state plus a term set
by the task (its instruction is the sample's text), so a trainer test can see
the loss fall. The preprocess job (real mp4 -> shards) is the production
writer; this is not it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from loongforge.shared import embodiment, statistics
from loongforge.shared.index import CameraInfo, DatasetInfo
from loongforge.shared.writer import RootWriter


def synthetic_episode(episode: int, frames: int, height: int, width: int, cameras: tuple[str, ...],
                      state_dim: int, action_dim: int, seed: int = 0) -> tuple[dict, dict]:
    """({slot: uint8 (T, 3h/2, w)}, arrays) of one deterministic episode."""
    rng = np.random.default_rng((seed, episode))
    t = np.arange(frames)[:, None, None]
    yy, xx = np.mgrid[0 : height * 3 // 2, 0:width]
    out = {}
    for c, cam in enumerate(cameras):
        img = ((xx[None] * 3 + yy[None] * 2 + t * (5 + c) + episode * 11) % 220 + 16).astype(np.uint8)
        img[:, 0, 0] = np.arange(frames) % 256  # frame tag
        out[cam] = img
    state = (rng.standard_normal(state_dim) + 0.1 * np.cumsum(rng.standard_normal((frames, state_dim)), axis=0))
    weights = np.random.default_rng(seed).standard_normal((state_dim, action_dim)) * 0.5  # the same every episode
    task = episode % 2
    arrays = {"state": state.astype(np.float32), "action": (state @ weights + (task - 0.5)).astype(np.float32),
              "timestamp": np.arange(frames) / 20.0, "frame_index": np.arange(frames, dtype=np.int64),
              "task_index": np.full(frames, task, np.int64)}
    return out, arrays


def synthetic_dataset_info(height: int, width: int, cameras: tuple[str, ...], state_dim: int,
                           action_dim: int, action_horizon: int = 4) -> DatasetInfo:
    return DatasetInfo(
        fps=20.0, height=height, width=width,
        cameras=tuple(CameraInfo(key=f"observation.images.{c}", slot=c, source_height=height, source_width=width,
                                 codec="synthetic") for c in cameras),
        state_dim=state_dim, action_dim=action_dim, action_horizon=action_horizon, frames_per_sample=1,
        modality=embodiment.plain_modality(state_dim, action_dim, cameras),
        stats={"state": {"mean": [0.0] * state_dim, "std": [1.0] * state_dim},
               "action": {"mean": [0.0] * action_dim, "std": [1.0] * action_dim}},
        source={"uri": "synthetic"}, tasks={"0": "pick up the red cube", "1": "open the drawer"})


def make_synthetic_root(root: str, *, lengths: tuple[int, ...] = (23, 9, 40, 17), episode_ids=None,
                        height: int = 16, width: int = 16, cameras: tuple[str, ...] = ("front", "wrist"),
                        state_dim: int = 6, action_dim: int = 4, block_size: int = 4, shard_size: int = 1 << 16,
                        val_episodes=(), seed: int = 0, block_codec: str = "zstd",
                        action_horizon: int = 4) -> dict[int, tuple[dict, dict]]:
    """Write a root; returns {episode id: (frames, arrays)} as written (the expected values).
    `action_horizon`: the default H recorded for loaders (DataConfig.action_horizon 0 takes it)."""
    ids = list(episode_ids) if episode_ids is not None else list(range(len(lengths)))
    info = synthetic_dataset_info(height, width, cameras, state_dim, action_dim, action_horizon)
    written = {}
    w = RootWriter(root, info, block_size=block_size, shard_size=shard_size, params={"synthetic": True},
                   created_by="loongforge.synthetic", block_codec=block_codec)
    spec = synthetic_embodiment(info)
    partials = []
    for ep, n in zip(ids, lengths):
        frames, arrays = synthetic_episode(ep, n, height, width, cameras, state_dim, action_dim, seed)
        w.add_episode(ep, frames, arrays)
        written[ep] = (frames, arrays)
        if ep not in set(val_episodes):  # statistics of the training episodes, as preprocess takes them
            partials.append(statistics.episode_partial(arrays, spec))
    if partials:  # an empty root has nothing to take statistics from
        w.dataset = dataclasses.replace(w.dataset, embodiment=statistics.embodiment_record(spec, partials))
    w.close(val_episodes=val_episodes)
    return written


def synthetic_embodiment(info: DatasetInfo) -> statistics.EmbodimentSpec:
    """new_embodiment over the root's one state and one action key, absolute (what preprocess derives)."""
    config = embodiment.derive_config(info.modality, info.slots, info.action_horizon)
    layout = embodiment.key_layout(config, info.modality, {"observation.state": "state", "action": "action",
                                                           "task_index": "task_index"},
                                   {"state": info.state_dim, "action": info.action_dim},
                                   {c.key: c.slot for c in info.cameras}, origin="synthetic")
    return statistics.EmbodimentSpec("new_embodiment", config, layout, {"observation.state": "state",
                                                                        "action": "action", "timestamp": "timestamp"},
                                     registered=False)
