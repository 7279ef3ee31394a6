"""The learning-rate schedule: linear warm-up, then cosine or linear decay (or constant).

Handed to `deepspeed.initialize` as its client scheduler, so DeepSpeed steps it once per applied
optimizer update (an update skipped for a non-finite loss does not advance it) and saves its
`state_dict` in every checkpoint's model-states file; `loongforge ckpt reshard` copies that file's
metadata, so the schedule resumes where it stopped on any layout. The state is plain numbers
(checkpoints load with weights_only).

Factor of the peak lr at update k (0-based), W warm-up updates, T = --steps:
    k < W:   (k + 1) / W                  the first update already moves; update W-1 reaches the peak
    cosine:  m + (1 - m) * (1 + cos(pi * p)) / 2,   p = (k - W) / max(1, T - W), clamped to [0, 1]
    linear:  m + (1 - m) * (1 - p)
    constant: 1 after the warm-up
with m = min_lr_ratio (GR00T's fine-tuning, HF's "cosine": warm-up ratio 0.05, decay to 0).
"""

from __future__ import annotations

import logging
import math

from loongforge.shared.errors import CheckpointError
from loongforge.train.config import OptimConfig

log = logging.getLogger(__name__)

SCHEDULE_VERSION = 1


def lr_factor(k: int, *, kind: str, warmup: int, total: int, min_ratio: float) -> float:
    """The multiplier of the peak learning rate at optimizer update k (module docstring)."""
    if k < warmup:
        return (k + 1) / warmup
    if kind == "constant":
        return 1.0
    p = min(1.0, max(0.0, (k - warmup) / max(1, total - warmup)))
    shape = (1.0 + math.cos(math.pi * p)) / 2.0 if kind == "cosine" else 1.0 - p
    return min_ratio + (1.0 - min_ratio) * shape


class LRSchedule:
    """Sets every param group's lr from `lr_factor`; `step()` after each applied update."""

    def __init__(self, optimizer, optim: OptimConfig, *, total_steps: int):
        self.optimizer = optimizer
        self.kind, self.peak, self.min_ratio = optim.lr_schedule, optim.lr, optim.min_lr_ratio
        self.total = total_steps
        self.warmup = optim.warmup_for(total_steps)
        self.updates = 0  # optimizer updates applied so far
        self.loaded = False  # set by load_state_dict: the trainer fast-forwards a schedule no checkpoint restored
        self._apply()

    @classmethod
    def factory(cls, optim: OptimConfig, total_steps: int):
        """What deepspeed.initialize(lr_scheduler=...) calls with its base optimizer."""
        return lambda optimizer: cls(optimizer, optim, total_steps=total_steps)

    def factor(self, k: int | None = None) -> float:
        return lr_factor(self.updates if k is None else k, kind=self.kind, warmup=self.warmup, total=self.total,
                         min_ratio=self.min_ratio)

    def _apply(self) -> None:
        lr = self.peak * self.factor()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, *_, **__) -> None:
        self.updates += 1
        self._apply()

    def fast_forward(self, updates: int) -> None:
        """A resume whose checkpoint state was not loaded (weights-only resume): continue at `updates`."""
        self.updates = updates
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    get_lr = get_last_lr

    def state_dict(self) -> dict:
        return {"version": SCHEDULE_VERSION, "updates": self.updates, "kind": self.kind, "peak_lr": self.peak,
                "warmup": self.warmup, "total": self.total, "min_ratio": self.min_ratio}

    def load_state_dict(self, state: dict) -> None:
        """The position comes from the checkpoint; the shape from this launch's flags. A changed shape
        (another --steps, --lr, --lr-schedule) is followed from the saved position, and said."""
        if state is None:  # saved before the schedule was a client scheduler: the trainer fast-forwards it
            log.warning("checkpoint holds no LR schedule state: the schedule continues at the resumed step")
            return
        if not isinstance(state, dict) or state.get("version") != SCHEDULE_VERSION:
            raise CheckpointError(f"LR schedule state {state!r:.120} is not version {SCHEDULE_VERSION}: this "
                                  "checkpoint was written by another scheduler; resume it with the release that "
                                  "wrote it")
        saved = {k: state[k] for k in ("kind", "peak_lr", "warmup", "total", "min_ratio")}
        mine = {k: v for k, v in self.state_dict().items() if k in saved}
        if saved != mine:
            changed = ", ".join(f"{k} {saved[k]} -> {mine[k]}" for k in saved if saved[k] != mine[k])
            log.warning("LR schedule changed on resume (%s): continuing the new one at update %d", changed,
                        state["updates"])
        self.updates = int(state["updates"])
        self.loaded = True
        self._apply()
