"""Normalisation statistics, computed inside the pipeline: mean/std/min/max of state and action over
every frame of the TRAINING episodes (`dataset.stats`), and GR00T N1.6's statistics of the run's
embodiment (`dataset.embodiment`: shared/statistics.py, the same numbers Isaac-GR00T computes).

The convert stage emits one partial per converted episode (`episode_moments`);
finalize collects them (finalize.JobResultsFn), decides the validation split and
merges the partials of the other episodes only (`norm_stats`): statistics that saw
the validation episodes would leak them into training through the normalisation.

Determinism: Beam combines partial results in whatever order bundles finish,
and float merges are not associative, so merging in arrival order would make
`index.json` differ between identical runs. The job therefore keeps one partial
per episode (a few numbers per dimension) and `norm_stats` merges them in
episode order (Chan et al.'s parallel mean/variance update).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared import statistics
from loongforge.shared.statistics import EmbodimentSpec, embodiment_record  # noqa: F401 - the stage's API


@dataclass(frozen=True, slots=True)
class Moments:
    count: int
    mean: tuple[float, ...]
    m2: tuple[float, ...]  # sum of squared deviations from the mean
    min: tuple[float, ...]
    max: tuple[float, ...]

    @classmethod
    def of(cls, rows: np.ndarray) -> "Moments":
        x = np.asarray(rows, dtype=np.float64)
        mean = x.mean(axis=0)
        return cls(count=int(x.shape[0]), mean=tuple(mean.tolist()), m2=tuple(((x - mean) ** 2).sum(axis=0).tolist()),
                   min=tuple(x.min(axis=0).tolist()), max=tuple(x.max(axis=0).tolist()))

    def merge(self, other: "Moments") -> "Moments":
        n = self.count + other.count
        a_mean, b_mean = np.asarray(self.mean), np.asarray(other.mean)
        delta = b_mean - a_mean
        mean = a_mean + delta * (other.count / n)
        m2 = np.asarray(self.m2) + np.asarray(other.m2) + delta**2 * (self.count * other.count / n)
        return Moments(count=n, mean=tuple(mean.tolist()), m2=tuple(m2.tolist()),
                       min=tuple(np.minimum(self.min, other.min).tolist()),
                       max=tuple(np.maximum(self.max, other.max).tolist()))

    def summary(self) -> dict:
        std = np.sqrt(np.asarray(self.m2) / max(self.count, 1))
        return {"count": self.count, "mean": list(self.mean), "std": std.tolist(), "min": list(self.min),
                "max": list(self.max)}


def episode_moments(episode: int, state: np.ndarray, action: np.ndarray, arrays: dict | None = None,
                    spec: EmbodimentSpec | None = None) -> tuple[int, dict]:
    """One episode's partial: Moments of state and action, and with an embodiment its float features'
    rows and its relative-action chunks (N1.6's statistics need every value: quantiles)."""
    out: dict = {"state": Moments.of(state), "action": Moments.of(action)}
    if spec is not None and arrays is not None:
        out.update(statistics.episode_partial(arrays, spec))
    return episode, out


def norm_stats(per_episode: dict, exclude=()) -> dict:
    """{episode: {"state": Moments, "action": Moments}} -> {"state": {...}, "action": {...}} over the
    episodes not in `exclude`, merged in episode order (deterministic bytes)."""
    skip = {int(e) for e in exclude}
    out = {}
    for name in ("state", "action"):
        total = None
        for episode in sorted(e for e in per_episode if int(e) not in skip):
            part = per_episode[episode][name]
            total = part if total is None else total.merge(part)
        if total is not None:
            out[name] = total.summary()
    return out
