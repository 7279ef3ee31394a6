"""GR00T N1.6's state and action processing for one embodiment: per modality key, in the modality
config's key order, exactly as Isaac-GR00T's StateActionProcessor (with N1.6's fine-tuning settings:
sin/cos state keys on, relative actions on, min/max to [-1, 1] with clipping, no percentiles).

State, per key:   sin/cos keys    [sin(x), cos(x)]                 (twice the width, no statistics)
                  mean/std keys   (x - mean) / std, x where std = 0 (no clipping)
                  otherwise       2 (x - lo) / (hi - lo) - 1, 0 where hi ~ lo, clipped to [-1, 1]
Action, per key:  RELATIVE keys first taken against the raw state of their state key at the current
                  frame (shared/pose.py); then mean/std or min/max, both clipped; a relative key's
                  statistics are per horizon step (H, D) and always min/max (never percentiles)
Decode (model output -> robot units): the inverse per key (min/max clips first; mean/std does not),
then relative -> absolute from the raw state.

Precision follows the reference so that the same inputs give the same float32 values: raw values
are float32, statistics float64; an absolute key is normalised in its input dtype (float32), a
relative key in float64; the concatenated action is rounded to float32 once.

Everything takes and returns dicts keyed by modality key (GR00T's observation layout), with leading
batch dimensions; `EpisodeRows` is the per-episode fast path the decode workers use (the absolute
keys normalised once per episode, relative keys per sample), equal to the per-sample path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared import embodiment as emb
from loongforge.shared import pose
from loongforge.shared.embodiment import EmbodimentConfig
from loongforge.shared.errors import ConfigError, FormatError
from loongforge.shared.statistics import feature_stats


@dataclass(frozen=True, kw_only=True, slots=True)
class StateActionOptions:
    """Isaac-GR00T's processor switches (processor_config.json's processor_kwargs)."""

    use_percentiles: bool = False
    clip_outliers: bool = True
    apply_sincos_state_encoding: bool = True
    use_relative_action: bool = True

    def to_dict(self) -> dict:
        return {"use_percentiles": self.use_percentiles, "clip_outliers": self.clip_outliers,
                "apply_sincos_state_encoding": self.apply_sincos_state_encoding,
                "use_relative_action": self.use_relative_action}


def _minmax(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    live = ~np.isclose(hi, lo)
    out[..., live] = (x[..., live] - lo[..., live]) / (hi[..., live] - lo[..., live])
    out[..., live] = 2 * out[..., live] - 1
    return out


def _meanstd(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    live = std != 0
    out[..., live] = (x[..., live] - mean[..., live]) / std[..., live]
    out[..., ~live] = x[..., ~live]
    return out


def _unmeanstd(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    live = std != 0
    out[..., live] = x[..., live] * std[..., live] + mean[..., live]
    out[..., ~live] = x[..., ~live]
    return out


@dataclass(frozen=True)
class RootEmbodiment:
    """What a shard root says of its embodiment: tag, modality config, key layout, its own statistics."""

    tag: str
    config: EmbodimentConfig
    layout: dict
    statistics: dict


def root_embodiment(info, ds=None) -> RootEmbodiment:
    """A root's recorded embodiment (DatasetInfo.embodiment); for a root written before it, new_embodiment
    over its modality.json groups, absolute, with the min/max preprocess recorded, or without those the
    statistics of its training episodes' arrays, taken now from `ds` (a shared.dataset.Dataset)."""
    rec = info.embodiment
    if rec:
        return RootEmbodiment(rec["tag"], EmbodimentConfig.from_json(rec["config"], "the root's embodiment"),
                              emb.layout_from_json(rec["layout"]), rec["statistics"])
    modality = info.modality if (info.modality or {}).get("state") else \
        emb.plain_modality(info.state_dim, info.action_dim, info.slots)
    config = emb.derive_config(modality, info.slots, info.action_horizon or 16)
    arrays = {"observation.state": "state", "action": "action", "task_index": "task_index"}
    layout = emb.key_layout(config, modality, arrays, {"state": info.state_dim, "action": info.action_dim},
                            {c.key: c.slot for c in info.cameras}, origin="the root")
    stats: dict = {"state": {}, "action": {}, "relative_action": {}}
    recorded = info.stats if all(info.stats.get(k, {}).get("min") for k in ("state", "action")) else None
    if recorded is None and ds is not None:
        rows = [ds.read_arrays(e) for e in np.flatnonzero(~np.asarray(ds.val_mask, bool))]
        recorded = {k: feature_stats(np.concatenate([np.asarray(r[k], np.float32) for r in rows]))
                    for k in ("state", "action")}
    for kind in ("state", "action"):
        st = (recorded or {}).get(kind, {})
        if not st.get("min"):
            raise ConfigError(f"the shard root records no {kind} statistics: re-run `loongforge preprocess` on it")
        for key, slc in layout[kind].items():
            # q01 / q99 were not recorded: the min / max stand in (read only with use_percentiles)
            fallback = {"q01": "min", "q99": "max"}
            pick = {s: list(st.get(s, st.get(fallback.get(s, s), [])))[slc.start:slc.end]
                    for s in ("min", "max", "mean", "std", "q01", "q99")}
            stats[kind][key] = pick
    return RootEmbodiment("new_embodiment", config, layout, stats)


class StateAction:
    def __init__(self, config: EmbodimentConfig, statistics: dict, options: StateActionOptions = StateActionOptions(),
                 tag: str = ""):
        self.config, self.options, self.tag = config, options, tag
        self.statistics = statistics
        st, ac = config.state, config.action
        self.sincos = set(st.sin_cos_embedding_keys or ()) if options.apply_sincos_state_encoding else set()
        self.state_meanstd = set(st.mean_std_embedding_keys or ())
        self.action_meanstd = set(ac.mean_std_embedding_keys or ())
        self.relative = {k: ac.action_config(k) for k in ac.modality_keys
                         if ac.action_config(k).relative and options.use_relative_action}
        self.state_params = {k: self._params(statistics, "state", k) for k in st.modality_keys}
        self.action_params = {k: self._params(statistics, "relative_action" if k in self.relative else "action", k)
                              for k in ac.modality_keys}
        self.state_dims = {k: len(self.state_params[k]["mean"]) for k in st.modality_keys}
        self.action_dims = {k: int(np.shape(self.statistics["action"][k]["mean"])[-1]) for k in ac.modality_keys}
        for k, ref in self.relative.items():
            sk = ref.state_key or k
            if self.state_dims[sk] != self.action_dims[k]:
                raise ConfigError(f"{tag}: relative action {k!r} has {self.action_dims[k]} values, its state key "
                                  f"{sk!r} {self.state_dims[sk]}")

    def _params(self, statistics: dict, kind: str, key: str) -> dict:
        try:
            s = statistics[kind][key]
        except KeyError:
            what = "relative-action statistics" if kind == "relative_action" else f"{kind} statistics"
            raise ConfigError(f"{self.tag or 'embodiment'}: no {what} for key {key!r}: re-run `loongforge "
                              "preprocess` with this modality config") from None
        relative = kind == "relative_action"
        lo, hi = ("q01", "q99") if self.options.use_percentiles and not relative else ("min", "max")
        out = {"min": np.array(s[lo]), "max": np.array(s[hi]), "mean": np.array(s["mean"]), "std": np.array(s["std"])}
        if relative and out["min"].shape[0] != self.horizon:
            raise ConfigError(f"{self.tag}: relative statistics of {key!r} cover {out['min'].shape[0]} steps, the "
                              f"modality config's horizon is {self.horizon}")
        return out

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def horizon(self) -> int:
        return self.config.horizon

    @property
    def state_dim(self) -> int:
        """Width of the processed state (sin/cos keys count twice)."""
        return sum(d * (2 if k in self.sincos else 1) for k, d in self.state_dims.items())

    @property
    def action_dim(self) -> int:
        return sum(self.action_dims.values())

    @property
    def raw_state_dim(self) -> int:
        return sum(self.state_dims.values())

    def action_slices(self) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for k in self.config.action.modality_keys:
            out[k] = (at, at + self.action_dims[k])
            at += self.action_dims[k]
        return out

    def state_slices(self) -> dict[str, tuple[int, int]]:
        """[start, end) of each raw state key in the raw state concatenated in key order."""
        out, at = {}, 0
        for k in self.config.state.modality_keys:
            out[k] = (at, at + self.state_dims[k])
            at += self.state_dims[k]
        return out

    # ---- per key ----------------------------------------------------------------------------------
    def state_key(self, key: str, x: np.ndarray) -> np.ndarray:
        if key in self.sincos:
            return np.concatenate([np.sin(x), np.cos(x)], axis=-1)
        p = self.state_params[key]
        if key in self.state_meanstd:
            return _meanstd(x, p["mean"], p["std"])
        out = _minmax(x, p["min"], p["max"])
        return np.clip(out, -1.0, 1.0) if self.options.clip_outliers else out

    def action_key(self, key: str, x: np.ndarray) -> np.ndarray:
        """One key's action (..., H, D), already relative where its config says: normalised, clipped."""
        p = self.action_params[key]
        out = _meanstd(x, p["mean"], p["std"]) if key in self.action_meanstd else _minmax(x, p["min"], p["max"])
        return np.clip(out, -1.0, 1.0) if self.options.clip_outliers else out

    # ---- whole samples ----------------------------------------------------------------------------
    def _check(self, values: dict, kind: str, dims: dict) -> None:
        missing = [k for k in dims if k not in values]
        if missing:
            raise ConfigError(f"{kind} keys {missing} missing; the embodiment {self.tag or ''} has {list(dims)}")
        for k, d in dims.items():
            if np.shape(values[k])[-1] != d:
                raise ConfigError(f"{kind} key {k!r}: {np.shape(values[k])[-1]} values, the embodiment has {d}")

    def state(self, raw: dict) -> np.ndarray:
        """{key: (..., K, D) raw float32} -> (..., K, state_dim) float32."""
        self._check(raw, "state", self.state_dims)
        parts = [self.state_key(k, np.asarray(raw[k], np.float32)) for k in self.config.state.modality_keys]
        return np.concatenate(parts, axis=-1).astype(np.float32)

    def relative_action(self, action: dict, state: dict) -> dict:
        """{key: (..., H, D)} raw actions -> the same with RELATIVE keys taken against the raw state's last
        row (state {key: (..., K, D)}): float64 for those keys, the others unchanged."""
        out = dict(action)
        for k, ref in self.relative.items():
            s = np.asarray(state[ref.state_key or k])[..., -1, :]
            out[k] = pose.to_relative(action[k], s, ref.type, ref.format)
        return out

    def action(self, raw: dict, state: dict) -> np.ndarray:
        """{key: (..., H, D) raw float32} and the raw state {key: (..., K, D)} -> (..., H, action_dim) float32."""
        self._check(raw, "action", self.action_dims)
        rel = self.relative_action({k: np.asarray(v, np.float32) for k, v in raw.items()}, state)
        parts = [self.action_key(k, rel[k]) for k in self.config.action.modality_keys]
        return np.concatenate(parts, axis=-1).astype(np.float32)

    def decode(self, action: np.ndarray, state: dict) -> dict:
        """Normalised model output (..., >= H, >= action_dim) -> {key: (..., H, D) float64} in robot units,
        RELATIVE keys made absolute from the raw state {key: (..., K, D)} (its last row)."""
        action = np.asarray(action)
        if action.shape[-2] < self.horizon or action.shape[-1] < self.action_dim:
            raise ConfigError(f"decode: action of shape {action.shape}, the embodiment needs at least "
                              f"({self.horizon}, {self.action_dim}) in its last two dims")
        out = {}
        for k, (a, b) in self.action_slices().items():
            x, p = action[..., :self.horizon, a:b], self.action_params[k]
            if k in self.action_meanstd:
                out[k] = _unmeanstd(x, p["mean"], p["std"])
            else:
                out[k] = (np.clip(x, -1.0, 1.0) + 1.0) / 2.0 * (p["max"] - p["min"]) + p["min"]
        for k, ref in self.relative.items():
            s = np.asarray(state[ref.state_key or k], np.float64)[..., -1, :]
            out[k] = pose.to_absolute(out[k], s, ref.type, ref.format)
        return out

    def concat(self, per_key: dict, kind: str = "action") -> np.ndarray:
        keys = self.config.action.modality_keys if kind == "action" else self.config.state.modality_keys
        return np.concatenate([np.asarray(per_key[k]) for k in keys], axis=-1)

    def split_state(self, raw: np.ndarray) -> dict:
        """A raw state concatenated in key order (..., raw_state_dim) -> {key: (..., D)}."""
        return {k: raw[..., a:b] for k, (a, b) in self.state_slices().items()}


class EpisodeRows:
    """One episode's samples as the decode workers build them: the processed state of every frame and
    the absolute action keys normalised once (elementwise: normalise-then-slice = slice-then-normalise),
    relative keys per sample. `fill` equals StateAction.state/action on the sample's raw rows."""

    __slots__ = ("sa", "length", "state", "absolute", "zero", "raw_action", "raw_ref", "raw_state_all",
                 "raw_action_all", "_cols")

    def __init__(self, sa: StateAction, arrays: dict, layout: dict, length: int, episode: int):
        self.sa, self.length = sa, length

        def key(kind: str, k: str) -> np.ndarray:
            s = layout[kind][k]
            arr = arrays.get(s.array)
            if arr is None:
                raise FormatError(f"episode {episode}: no {s.array!r} array for {kind} key {k!r}")
            arr = np.asarray(arr, np.float32).reshape(len(arr), -1)
            if len(arr) != length or arr.shape[1] < s.end:
                raise FormatError(f"episode {episode}: {s.array} is {arr.shape}, {kind} key {k!r} needs [{s.start}:"
                                  f"{s.end}] of {length} rows")
            return arr[:, s.start:s.end]

        raw_state = {k: key("state", k) for k in sa.config.state.modality_keys}
        raw_action = {k: key("action", k) for k in sa.config.action.modality_keys}
        self.state = sa.state({k: v[:, None] for k, v in raw_state.items()})[:, 0]  # (L, Ds) per frame
        self.raw_state_all, self.raw_action_all = sa.concat(raw_state, "state"), sa.concat(raw_action)
        self.absolute, self.zero, self.raw_action, self.raw_ref = {}, {}, {}, {}
        self._cols = sa.action_slices()
        for k, raw in raw_action.items():
            if k in sa.relative:
                self.raw_action[k] = raw
                self.raw_ref[k] = raw_state[sa.relative[k].state_key or k]
            else:
                self.absolute[k] = sa.action_key(k, raw)
                self.zero[k] = sa.action_key(k, np.zeros((1, raw.shape[1]), np.float32))[0]

    def fill(self, state_rows, action_rows, zero_rows, out_state: np.ndarray, out_action: np.ndarray) -> None:
        """Write a sample's processed state (frames `state_rows`) and action chunk (frames `action_rows`,
        clamped into the episode; `zero_rows` None or the rows padded with zeros) in place."""
        out_state[...] = self.state[state_rows]
        ref_t = int(state_rows[-1])
        for k, (a, b) in self._cols.items():
            if k in self.absolute:
                out_action[:, a:b] = self.absolute[k][action_rows]
                if zero_rows is not None:
                    out_action[zero_rows, a:b] = self.zero[k]
                continue
            ref = self.sa.relative[k]
            raw = self.raw_action[k][action_rows]
            if zero_rows is not None:
                raw[zero_rows] = 0.0
            rel = pose.to_relative(raw, self.raw_ref[k][ref_t], ref.type, ref.format)
            out_action[:, a:b] = self.sa.action_key(k, rel)
