"""GR00T N1.6's normalisation statistics, computed as Isaac-GR00T computes them (gr00t/data/stats.py,
sharded_mixture_dataset.merge_statistics), so the same data gives the same numbers:

* per float feature of the dataset (every info.json feature whose dtype is a float, over every row,
  short episodes included): mean, std (population), min, max, q01, q99 (np.quantile, linear), taken
  by the same numpy reductions on the same float32 rows in episode order (`feature_stats`);
* per state/action key: the [start:end] slices of its column's statistics (`key_stats`);
* per RELATIVE action key: the statistics, per horizon step and dimension (H, D), of every chunk
  a_{i..i+H-1} made relative to the state at i, for i in 0 .. L-H of every episode (`relative_chunks`,
  then `feature_stats` over the stacked chunks);
* several datasets of one embodiment merged with their sampling weights (`merge`): mean = sum w mu,
  std = sqrt(sum w (sigma^2 + mu^2) - mean^2), min of mins, max of maxes, q01 the min, q99 the max.

Quantiles need every value: the statistics hold all float rows of a dataset (and H x the relative
keys' rows) in memory at once, as Isaac-GR00T's stats.py does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loongforge.shared import pose
from loongforge.shared.embodiment import EmbodimentConfig, KeySlice, layout_to_json
from loongforge.shared.errors import SourceDataError

STATS = ("mean", "std", "min", "max", "q01", "q99")


def feature_stats(rows: np.ndarray) -> dict:
    """{stat: list} of float32 rows (N, ...) reduced over axis 0, as Isaac-GR00T's numpy calls do."""
    x = np.asarray(rows, np.float32)
    return {"mean": np.mean(x, axis=0).tolist(), "std": np.std(x, axis=0).tolist(),
            "min": np.min(x, axis=0).tolist(), "max": np.max(x, axis=0).tolist(),
            # NOTE: the quantiles' interpolation in float64: numpy 1.x (Isaac-GR00T's) lerps float32 values with a
            # float64 weight and keeps float64; numpy 2 stays in float32 (1 ulp off the reference)
            "q01": np.quantile(x.astype(np.float64), 0.01, axis=0).tolist(),
            "q99": np.quantile(x.astype(np.float64), 0.99, axis=0).tolist()}


def key_stats(features: dict, slc: KeySlice, column: str) -> dict:
    st = features[column]
    return {s: list(st[s][slc.start:slc.end]) for s in STATS}


def relative_chunks(state: np.ndarray, action: np.ndarray, config: EmbodimentConfig, key: str) -> np.ndarray:
    """(chunks, H, D) float32: the relative chunks of one episode for RELATIVE action `key`.
    state: the raw reference-state key's rows (L, D); action: the key's raw rows (L, D)."""
    deltas = np.asarray(config.action.delta_indices, np.int64)
    usable = len(action) - int(deltas[-1])
    if usable <= 0:
        return np.zeros((0, len(deltas), action.shape[1]), np.float32)
    ref_rows = np.arange(usable) + int(config.state.delta_indices[-1])
    chunks = np.asarray(action, np.float32)[np.arange(usable)[:, None] + deltas[None, :]]
    ac = config.action.action_config(key)
    rel = pose.to_relative(chunks, np.asarray(state, np.float32)[ref_rows], ac.type, ac.format)
    return rel.astype(np.float32)


def merge(per_dataset: list[dict], weights, relative: bool = False) -> dict:
    """{key: stats} of several datasets of one tag -> merged {key: stats} (Isaac-GR00T's merge_statistics)."""
    w = np.asarray(weights, np.float64)
    w = w / w.sum()
    out = {}
    for key in per_dataset[0]:
        shape = np.asarray(per_dataset[0][key]["mean"]).shape if relative else [len(per_dataset[0][key]["mean"])]
        means, squares = np.zeros(shape), np.zeros(shape)
        mins, maxs, q01, q99 = [], [], [], []
        for wi, stats in zip(w, per_dataset):
            s = stats[key]
            mu, sd = np.array(s["mean"]), np.array(s["std"])
            means += wi * mu
            squares += wi * (sd**2 + mu**2)
            mins.append(s["min"])
            maxs.append(s["max"])
            q01.append(s["q01"])
            q99.append(s["q99"])
        out[key] = {"min": np.min(np.array(mins), axis=0).tolist(), "max": np.max(np.array(maxs), axis=0).tolist(),
                    "mean": means.tolist(), "std": np.sqrt(squares - means**2).tolist(),
                    "q01": np.min(np.array(q01), axis=0).tolist(), "q99": np.max(np.array(q99), axis=0).tolist()}
    return out


def merge_embodiment(per_dataset: list[dict], weights) -> dict:
    """Each dataset's {"state"|"action"|"relative_action": {key: stats}} of one tag -> the merged dict."""
    out = {}
    for kind in ("state", "action", "relative_action"):
        if kind in per_dataset[0] and per_dataset[0][kind]:
            out[kind] = merge([d[kind] for d in per_dataset], weights, relative=kind == "relative_action")
        elif kind in per_dataset[0]:
            out[kind] = {}
    return out


# ---- one dataset's record (preprocess's finalize, the synthetic roots) --------------------------------
@dataclass(frozen=True)
class EmbodimentSpec:
    """The embodiment a root records, resolved against its dataset before any work: tag, modality config,
    where each key lives (embodiment.key_layout) and the float features (info.json features with a float
    dtype -> the episode array holding them)."""

    tag: str
    config: EmbodimentConfig
    layout: dict
    float_features: dict = field(default_factory=dict)  # feature name -> episode array
    registered: bool = True  # False: the user's --modality-config, or a config derived from the dataset

    def column_of(self, array: str) -> str:
        return next(f for f, a in self.float_features.items() if a == array)


def _cols(arrays: dict, slc: KeySlice, rows: int) -> np.ndarray:
    return np.asarray(arrays[slc.array], np.float32).reshape(rows, -1)[:, slc.start:slc.end]


def episode_partial(arrays: dict, spec: EmbodimentSpec) -> dict:
    """One episode's share of the statistics: its float features' rows and its relative chunks."""
    rows = len(arrays["state"])
    out: dict = {"features": {f: np.asarray(arrays[a], np.float32).reshape(rows, -1)
                              for f, a in spec.float_features.items() if a in arrays}, "relative": {}}
    for key in spec.config.action.modality_keys:
        ac = spec.config.action.action_config(key)
        if ac.relative:
            s, a = spec.layout["state"][ac.state_key or key], spec.layout["action"][key]
            out["relative"][key] = relative_chunks(_cols(arrays, s, rows), _cols(arrays, a, rows), spec.config, key)
    return out


def embodiment_record(spec: EmbodimentSpec, partials: list[dict]) -> dict:
    """A root's `dataset.embodiment` from its episodes' partials (in episode order): tag, config, key
    layout, and N1.6's statistics (every float feature as stats.json, per key, relative per step)."""
    if not partials:
        raise SourceDataError("no training episode to take the normalisation statistics from")
    features = {f: feature_stats(np.concatenate([p["features"][f] for p in partials]))
                for f in spec.float_features if partials and all(f in p["features"] for p in partials)}
    stats: dict = {"state": {}, "action": {}, "relative_action": {}}
    for kind in ("state", "action"):
        for key, slc in spec.layout[kind].items():
            stats[kind][key] = key_stats(features, slc, spec.column_of(slc.array))
    for key in spec.config.action.modality_keys:
        if spec.config.action.action_config(key).relative:
            chunks = [p["relative"][key] for p in partials]
            if not sum(len(c) for c in chunks):
                raise SourceDataError(f"relative action {key!r}: no episode has the {spec.config.horizon} frames of "
                                      "an action chunk, so there are no relative statistics")
            stats["relative_action"][key] = feature_stats(np.concatenate(chunks))
    return {"tag": spec.tag, "registered": spec.registered, "config": spec.config.to_json(),
            "layout": layout_to_json(spec.layout), "statistics": stats, "feature_statistics": features}
