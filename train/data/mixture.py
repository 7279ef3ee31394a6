"""Several shard roots in one run, each with its own embodiment and statistics, mixed by ratio
(`loongforge train --data A:3 --data B:1`).

N1.6's rule (Isaac-GR00T's ShardedMixtureDataset): a dataset's expected share of the samples is its
ratio alone, not ratio x size (its shard picks are weighted by ratio / average shard size, and a
shard yields all its steps). Here every global batch comes from one root (as N1.6's batches come
from one shard, but at its boundaries), and each mixture epoch is a fixed, seeded schedule of roots:
over an epoch of N batches (the roots' own batches per epoch, summed), root i gets round(N w_i)
of them, in an order shuffled by (seed, mixture epoch): the shares are the ratios to within one
batch, and the schedule is one deterministic global order for every rank layout.

Each root is read by its own BlockLoader (its order, its epochs, its decode workers); a root picked
past the end of its own epoch goes on into its next. The state is the schedule position plus each
root's loader state (global positions, so an elastic resume on another rank count reads the same
samples); a mid-epoch resume continues the same sequence exactly.
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import CheckpointError, ConfigError

MIXTURE_STATE_VERSION = 1


def allot(ratios, total: int) -> np.ndarray:
    """Batches per root in a schedule of `total`: proportional to the ratios, largest remainders first."""
    w = np.asarray(ratios, np.float64)
    if (w <= 0).any():
        raise ConfigError(f"mixture ratios {list(ratios)}: every ratio must be > 0")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts


def schedule(ratios, total: int, seed: int, epoch: int) -> np.ndarray:
    """The roots of one mixture epoch's `total` batches, in order."""
    picks = np.repeat(np.arange(len(ratios)), allot(ratios, total))
    return np.random.default_rng([seed, epoch, 0x6D6978]).permutation(picks)


class MixtureLoader:
    def __init__(self, loaders: list, ratios: list[float], *, seed: int = 0, max_steps: int | None = None):
        if len(loaders) != len(ratios) or not loaders:
            raise ConfigError("mixture: one ratio per root")
        self.loaders, self.ratios, self.seed, self.max_steps = list(loaders), list(ratios), seed, max_steps
        self.epoch_batches = max(1, sum(ld.plan.steps for ld in loaders))
        allot(ratios, self.epoch_batches)  # validates the ratios now
        self.epoch, self.position, self.steps_done = 0, 0, 0
        self._iters: list = [None] * len(loaders)
        self._schedule: tuple[int, np.ndarray] | None = None

    def _root_at(self) -> int:
        if self._schedule is None or self._schedule[0] != self.epoch:
            self._schedule = (self.epoch, schedule(self.ratios, self.epoch_batches, self.seed, self.epoch))
        return int(self._schedule[1][self.position])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.max_steps is not None and self.steps_done >= self.max_steps:
            raise StopIteration
        i = self._root_at()
        if self._iters[i] is None:
            self._iters[i] = iter(self.loaders[i])
        batch = next(self._iters[i])
        batch["meta"]["dataset"] = i
        self.position += 1
        if self.position == self.epoch_batches:
            self.epoch, self.position = self.epoch + 1, 0
        self.steps_done += 1
        return batch

    @property
    def bad_samples(self) -> int:
        return sum(ld.bad_samples for ld in self.loaders)

    def state_dict(self) -> dict:
        return {"version": MIXTURE_STATE_VERSION, "mixture": {"ratios": self.ratios, "seed": self.seed,
                                                              "epoch_batches": self.epoch_batches},
                "epoch": self.epoch, "position": self.position, "steps_done": self.steps_done,
                "roots": [ld.state_dict() for ld in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != MIXTURE_STATE_VERSION or "roots" not in state:
            raise CheckpointError("the checkpoint's loader state is not a mixture's: resume with the --data roots "
                                  "the run started with")
        mine = {"ratios": self.ratios, "seed": self.seed, "epoch_batches": self.epoch_batches}
        if state["mixture"] != mine or len(state["roots"]) != len(self.loaders):
            raise CheckpointError(f"checkpoint's mixture {state['mixture']} ({len(state['roots'])} roots), this run's "
                                  f"{mine} ({len(self.loaders)}): the sample sequence would change; resume with the "
                                  "same --data roots and ratios")
        for ld, st in zip(self.loaders, state["roots"]):
            ld.load_state_dict(st)
        self.epoch, self.position, self.steps_done = int(state["epoch"]), int(state["position"]), \
            int(state["steps_done"])
        self._iters = [None] * len(self.loaders)

    def close(self) -> None:
        for ld in self.loaders:
            ld.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
