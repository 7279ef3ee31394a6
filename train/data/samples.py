"""Sample semantics: a sample is (episode, t), derived from the index, never listed.

Every `stride`-th timestep of every episode is a sample (GR00T N1.x: every timestep,
stride 1). What a sample reads is given per modality as delta indices around t:

    video   t + d for d in `video` (default (0,), GR00T's; e.g. (-6, -4, -2, 0) for history)
    state   t + d for d in `state` (default: the video deltas, so state row k is frame k's)
    action  t, t+1, ..., t+H-1

Episode ends: GR00T N1.6 (`action_pad="none"`, the trainer's default) takes a sample only where its
whole action chunk lies in the episode: t = 0 .. T-H (`sample_lengths`: T-H+1 samples, none in an
episode shorter than H), as its ShardedSingleStepDataset with allow_padding=False. The padding
modes take every t and fill the chunk past the end: "last" repeats the last row (GR00T N1.5's
first_last), "zero" writes zeros; those rows are flagged invalid (`action_valid`), so the loss
ignores them rather than learn "stand still" from padding. Video and state indices are clamped
into [0, T-1].

Sample ids are global numbers over every episode in index order (stable whatever the split),
mapped to (episode, t) in O(log E) by `np.searchsorted` over the cumulative sample counts
of the memory-mapped `episode_lengths` column (bench: `benchmarks/micro/index_scale.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError

ACTION_PADS = ("none", "last", "zero")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaSpec:
    video: tuple[int, ...] = (0,)
    """Frame offsets around t per camera; sorted, unique. K = len(video) frames per sample."""
    state: tuple[int, ...] = ()
    """State row offsets; () = the video offsets. Must have len(video) entries (the model reads
    state row k beside frame k)."""
    action_horizon: int = 16
    """H: action rows t .. t+H-1 (GR00T N1.x: 16)."""
    action_pad: str = "last"
    """Rows past the episode end: none (no such sample, N1.6), last (repeat the last row) or zero."""

    def __post_init__(self):
        if not self.video or list(self.video) != sorted(set(self.video)):
            raise ConfigError(f"data.video_deltas: {self.video} must be non-empty, sorted and unique, "
                              "e.g. 0 or -6,-4,-2,0")
        if self.state and len(self.state) != len(self.video):
            raise ConfigError(f"data.state_deltas: {len(self.state)} offsets but {len(self.video)} video offsets; "
                              "give one per frame or leave it empty (= the video offsets)")
        if self.action_horizon < 1:
            raise ConfigError(f"data.action_horizon: {self.action_horizon}, must be >= 1")
        if self.action_pad not in ACTION_PADS:
            raise ConfigError(f"data.action_pad: {self.action_pad!r} not in {ACTION_PADS}")

    @property
    def frames(self) -> int:
        return len(self.video)

    @property
    def state_deltas(self) -> np.ndarray:
        return np.asarray(self.state or self.video, np.int64)


def sample_lengths(lengths, spec: DeltaSpec) -> np.ndarray:
    """Per episode, the timesteps that are samples (t < the result): every frame, or with action_pad
    "none" the T-H+1 whose whole chunk lies in the episode (N1.6's effective episode length)."""
    lengths = np.asarray(lengths, np.int64)
    if spec.action_pad != "none":
        return lengths
    return np.maximum(lengths - (spec.action_horizon - 1), 0)


def video_indices(t: int, length: int, spec: DeltaSpec) -> np.ndarray:
    """Frame numbers sample (e, t) shows, clamped into the episode (GR00T's get_video)."""
    return np.clip(t + np.asarray(spec.video, np.int64), 0, length - 1)


def state_indices(t: int, length: int, spec: DeltaSpec) -> np.ndarray:
    """State rows: first_last padding is the same as clamping."""
    return np.clip(t + spec.state_deltas, 0, length - 1)


def action_rows(t: int, length: int, spec: DeltaSpec) -> tuple[np.ndarray, np.ndarray]:
    """(rows, valid): the H rows from t, clamped to the last row, and which of them are real."""
    idx = t + np.arange(spec.action_horizon, dtype=np.int64)
    valid = idx < length
    return np.minimum(idx, length - 1), valid


def gather_actions(actions: np.ndarray, t: int, spec: DeltaSpec) -> tuple[np.ndarray, np.ndarray]:
    """(H, A) float32 chunk of an episode's (T, A) actions and its (H,) validity mask."""
    rows, valid = action_rows(t, len(actions), spec)
    out = actions[rows]
    if spec.action_pad == "zero":
        out[~valid] = 0.0
    return out, valid


class SampleTable:
    """(episode, t) of every sample of a dataset, from its episode lengths alone.

    O(E) memory (E episodes), never O(samples): 100 M samples in 100 k episodes is two
    800 KB arrays."""

    def __init__(self, lengths: np.ndarray, *, stride: int = 1):
        if stride < 1:
            raise ConfigError(f"data.sample_stride: {stride}, must be >= 1")
        self.lengths = np.asarray(lengths, np.int64)
        if (self.lengths < 0).any():
            raise ConfigError("episode_lengths holds a negative length: corrupt index")
        self.stride = stride
        self.counts = (self.lengths + stride - 1) // stride  # t = 0, s, 2s, ... < T
        self.ends = np.cumsum(self.counts)
        self.starts = self.ends - self.counts
        self.num_samples = int(self.ends[-1]) if len(self.ends) else 0

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Global sample ids (int or array) -> (episode, t) arrays."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"sample id out of range [0, {self.num_samples})")
        ep = np.searchsorted(self.ends, ids, side="right")
        return ep, (ids - self.starts[ep]) * self.stride

    def sample_id(self, episode: int, t: int) -> int:
        if t % self.stride or not 0 <= t < self.lengths[episode]:
            raise IndexError(f"t={t} is not a sample of episode {episode} (length {self.lengths[episode]}, "
                             f"stride {self.stride})")
        return int(self.starts[episode] + t // self.stride)

    def episode_of_all(self) -> np.ndarray:
        """Episode of every sample id (O(samples): for the order and masks, once per epoch)."""
        return np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts)

    def block_groups(self, block_size: int) -> np.ndarray:
        """Per sample id: the number of the (episode, block of t) it belongs to, ascending.

        Samples sharing a group read their t=0-delta frame from the same stored block, so
        serving them together costs one block decode."""
        ep = self.episode_of_all()
        t = (np.arange(self.num_samples, dtype=np.int64) - self.starts[ep]) * self.stride
        blocks_per_ep = (self.lengths + block_size - 1) // block_size
        first_block = np.cumsum(blocks_per_ep) - blocks_per_ep
        return first_block[ep] + t // block_size

    def group_table(self, block_size: int, train_episodes: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first sample id, size, episode) of every non-empty (episode, block of t) group, ascending:
        `block_groups` at O(blocks) instead of O(samples) (the lazy order, order.EpochOrder).

        Episodes where `train_episodes` is False are left out. A group's samples are the
        consecutive ids first .. first+size-1 (t = k*stride for k in [ceil(bB/s), ceil((b+1)B/s)))."""
        nb = (self.lengths + block_size - 1) // block_size
        if train_episodes is not None:
            nb = np.where(np.asarray(train_episodes, bool), nb, 0)
        # int32 per block where it fits: 100 M samples are 6.25 M blocks of 16, and these are the peak
        small = np.int32 if max(len(nb), int(self.lengths.max(initial=0)) + block_size) < 2**31 else np.int64
        ep = np.repeat(np.arange(len(nb), dtype=small), nb)
        b = np.arange(len(ep), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
        b = b.astype(small)
        count = self.counts.astype(small)[ep]
        lo = np.minimum(-(-b * block_size // self.stride), count)
        hi = np.minimum(-(-(b + 1) * block_size // self.stride), count)
        del b, count
        real = hi > lo  # a stride above B leaves some blocks without a sample
        ep, size = ep[real], (hi - lo)[real]
        return self.starts[ep] + lo[real], size, ep

    def keep_mask(self, train_episodes: np.ndarray | None) -> np.ndarray | None:
        """Bool per sample id from a bool per episode (the training split); None = all."""
        if train_episodes is None:
            return None
        return np.repeat(np.asarray(train_episodes, bool), self.counts)
