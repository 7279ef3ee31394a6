"""Small valid shard roots made without video or Beam, for cache/trainer tests
and benchmarks that need many shards fast. Content is a learnable toy task:
the action is a fixed linear function of the state plus the mean frame brightness.

The preprocess job (real mp4 -> shards) is what `make demo` uses; this is not it.
"""

from __future__ import annotations

import numpy as np

from loongforge.shared import paths
from loongforge.shared.format import Sample, pack_sample
from loongforge.shared.index import CameraInfo, DatasetInfo, ShardIndex, save_index
from loongforge.shared.writer import write_shard


def make_synthetic_root(root: str, *, shards: int = 4, samples_per_shard: int = 8, frames: int = 2,
                        height: int = 16, width: int = 16, cameras: tuple[str, ...] = ("front", "wrist"),
                        state_dim: int = 6, action_dim: int = 4, action_horizon: int = 4,
                        variable_frames: bool = False, seed: int = 0) -> ShardIndex:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((state_dim, action_dim)).astype(np.float32) * 0.5
    tasks = {"0": "pick up the red cube", "1": "open the drawer"}
    entries = []
    episode = 0
    for shard in range(shards):
        fragments = []
        for i in range(samples_per_shard):
            k = frames if not variable_frames else max(1, frames - (i % 2))
            frame_ids = np.arange(i * frames, i * frames + k, dtype=np.int64)
            state = rng.standard_normal((k, state_dim)).astype(np.float32)
            level = int(rng.integers(16, 235))
            imgs = {cam: np.full((k, height * 3 // 2, width), 128, np.uint8) for cam in cameras}
            for cam in cameras:
                imgs[cam][:, :height] = level
            base = state[-1] @ weights + (level - 128) / 128.0
            action = np.tile(base, (action_horizon, 1)).astype(np.float32)
            task_index = episode % 2
            key = paths.sample_key(episode, int(frame_ids[0]))
            sample = Sample(key=key, episode=episode, frame_indices=frame_ids, timestamps=frame_ids / 20.0,
                            frames=imgs, state=state, action=action, action_valid=action_horizon,
                            task=tasks[str(task_index)], task_index=task_index)
            fragments.append((key, k, pack_sample(sample)))
        entries.append(write_shard(root, paths.shard_name(shard), fragments))
        episode += 1
    ds = DatasetInfo(
        fps=20.0, height=height, width=width,
        cameras=tuple(CameraInfo(key=f"observation.images.{c}", slot=c, source_height=height,
                                 source_width=width, codec="synthetic") for c in cameras),
        state_dim=state_dim, action_dim=action_dim, action_horizon=action_horizon, frames_per_sample=frames,
        stats={"state": {"mean": [0.0] * state_dim, "std": [1.0] * state_dim},
               "action": {"mean": [0.0] * action_dim, "std": [1.0] * action_dim}},
        source={"uri": "synthetic", "seed": seed}, tasks=tasks,
    )
    index = ShardIndex(dataset=ds, shards=tuple(entries), params={"synthetic": True}, episodes=shards,
                       created_by="loongforge.synthetic")
    save_index(index, root)
    return index
