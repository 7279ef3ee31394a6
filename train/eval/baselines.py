"""What the training episodes say without any video: a ridge regression from state to action
chunk, and which action groups are discrete-valued (with their levels).

Both are read from the training episodes' per-frame arrays (no frame is decoded), the same
episodes and processing the trainer saw (processor.py: N1.6's per-key normalisation and relative
actions), so the eval's baselines are fitted on exactly the data the policy was:

* ridge-from-state: closed form on the model's own units, x = [the processed current state, 1] ->
  the processed (H, Da) chunk of every sample the loader takes, lambda = RIDGE_L2 per sample; its
  output is decoded to robot units as the policy's is. A policy that does not beat it has learnt
  nothing from the frames or the instruction.
* discrete-valued groups: an action key whose every dimension takes at most
  MAX_LEVELS distinct values on the training episodes (binary hand commands, gripper open/close),
  or that modality.json declares with "discrete": true (false forces continuous). For those
  the flow's continuous output can be snapped to the nearest learned level (openloop.py reports
  it beside the flow's own output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError
from loongforge.train.data.samples import sample_lengths
from loongforge.train.data.state_action import EpisodeRows

DISCRETE_MODES = ("flow", "snap")  # a discrete-valued group at inference: as the flow gives it, or
# snapped to its nearest training level (Policy.predict_action, openloop's columns)
DEFAULT_DISCRETE_MODE = "flow"  # N1.6's own output unless a run's validation says otherwise (train/README.md)
MAX_LEVELS = 8  # distinct training values of a dimension still called discrete-valued
RIDGE_L2 = 1e-3  # per-sample ridge penalty, normalised units (a well-posed solve, no visible shrinkage)
MAX_EPISODES = 500  # training episodes read for the fit (evenly spaced); bounds eval's start-up


@dataclass(frozen=True)
class TrainingReference:
    weights: np.ndarray  # (S + 1, H * Da): ridge from [normalised current state, 1] to the normalised chunk
    horizon: int
    levels: dict[int, np.ndarray]  # action dim -> its sorted distinct training values (discrete dims only)
    discrete_groups: tuple[str, ...]
    samples: int  # training samples the ridge was fitted on

    def ridge(self, state_n: np.ndarray) -> np.ndarray:
        """(B, S) normalised current states -> (B, H, Da) normalised chunks."""
        x = np.concatenate([state_n, np.ones((len(state_n), 1), state_n.dtype)], axis=1)
        return (x @ self.weights).reshape(len(state_n), self.horizon, -1)

    def snap(self, actions: np.ndarray, dims: list[int]) -> np.ndarray:
        """Dataset-unit actions (..., Da) with `dims` moved to the nearest training level."""
        out = np.array(actions, copy=True)
        for d in dims:
            lv = self.levels[d]
            out[..., d] = lv[np.abs(out[..., d, None] - lv).argmin(-1)]
        return out

    def discrete_dims(self, groups: dict[str, tuple[int, int]]) -> list[int]:
        return [d for g in self.discrete_groups for d in range(*groups[g])]


def action_groups(index) -> dict[str, tuple[int, int]]:
    """action key -> [start, end) in the action concatenated in the modality config's key order."""
    r = index.roots[0]
    out, at = {}, 0
    for k in r.config.action.modality_keys:
        d = r.keys["action"][k].dim
        out[k], at = (at, at + d), at + d
    return out


def group_modes(ref: TrainingReference, modes: str | dict | None) -> dict[str, str]:
    """The inference mode of each discrete-valued group: `modes` names one for all of them, or maps
    group -> mode (the others get DEFAULT_DISCRETE_MODE). A group that is not discrete-valued is refused."""
    if modes is None or isinstance(modes, str):
        modes = dict.fromkeys(ref.discrete_groups, modes or DEFAULT_DISCRETE_MODE)
    for g, m in modes.items():
        if g not in ref.discrete_groups:
            raise ConfigError(f"discrete mode for {g!r}: not a discrete-valued group (those are "
                              f"{list(ref.discrete_groups) or 'none'}; declare one with \"discrete\": true in "
                              "modality.json)")
        if m not in DISCRETE_MODES:
            raise ConfigError(f"discrete mode {m!r} for {g!r}: use one of {DISCRETE_MODES}")
    return {g: modes.get(g, DEFAULT_DISCRETE_MODE) for g in ref.discrete_groups}


def training_rows(data) -> list[int]:
    """Episode rows of the training split, at most MAX_EPISODES of them, evenly spaced."""
    rows = np.flatnonzero(~np.asarray(data.ds.val_mask))
    if len(rows) > MAX_EPISODES:
        rows = rows[np.linspace(0, len(rows) - 1, MAX_EPISODES).round().astype(np.int64)]
    return rows.tolist()


def state_chunk_pairs(data, processor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every training sample the loader takes, in the model's units: (x (N, S) the processed current
    state, y (N, H * Da) the processed chunk, the raw actions of those episodes (rows, Da))."""
    r = data.roots[0]
    sa, spec = processor.state_action(r.tag), r.deltas
    xs, ys, actions = [], [], []
    h = spec.action_horizon
    for row in training_rows(data):
        n = int(data.ds.episode_lengths[row])
        rows = EpisodeRows(sa, data.ds.read_arrays(row), r.keys, n, row)
        actions.append(rows.raw_action_all)
        last = n - 1
        for t in range(int(sample_lengths([n], spec)[0])):  # the samples the loader takes
            states = [min(max(t + d, 0), last) for d in spec.state_deltas]
            chunk = slice(t, t + h) if t + h <= n else [min(t + i, last) for i in range(h)]
            zero = slice(n - t, h) if t + h > n and spec.action_pad == "zero" else None
            x, y = np.empty((len(states), sa.state_dim), np.float32), np.empty((h, sa.action_dim), np.float32)
            rows.fill(states, chunk, zero, x, y)
            xs.append(x[-1])  # the current state, as the model's token
            ys.append(y.reshape(-1))
    if not xs:
        raise ConfigError("the training episodes hold no sample (every one shorter than the action horizon)")
    return np.stack(xs), np.stack(ys), np.concatenate(actions)


def ridge_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(S + 1, Y) weights of the ridge from [x, 1] to y, closed form, RIDGE_L2 per sample."""
    x = np.concatenate([x, np.ones((len(x), 1), np.float32)], axis=1).astype(np.float64)
    reg = RIDGE_L2 * len(x) * np.eye(x.shape[1])
    reg[-1, -1] = 0.0  # the bias is not shrunk
    return np.linalg.solve(x.T @ x + reg, x.T @ y.astype(np.float64)).astype(np.float32)


def fit_reference(data, groups: dict[str, tuple[int, int]], processor) -> TrainingReference:
    """The ridge baseline and the discrete-valued groups of a TrainingData's training episodes."""
    x, y, actions = state_chunk_pairs(data, processor)
    h = data.roots[0].deltas.action_horizon
    levels, discrete = _levels(actions, groups, data.dataset.modality)
    return TrainingReference(ridge_fit(x, y), h, levels, discrete, len(x))


def _levels(actions: np.ndarray, groups: dict, modality) -> tuple[dict[int, np.ndarray], tuple[str, ...]]:
    declared = modality.get("action", {}) if isinstance(modality, dict) else {}
    levels, discrete = {}, []
    for name, (a, b) in groups.items():
        values = [np.unique(actions[:, d]) for d in range(a, b)]
        flag = declared.get(name, {}).get("discrete") if isinstance(declared.get(name), dict) else None
        if flag is None:
            flag = all(len(v) <= MAX_LEVELS for v in values)
        if flag:
            discrete.append(name)
            levels.update({d: v.astype(np.float32) for d, v in zip(range(a, b), values)})
    return levels, tuple(discrete)
