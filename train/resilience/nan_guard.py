"""NaN guard: a non-finite loss (or gradient norm) skips the optimizer step on
every rank, is counted in metrics.jsonl, and never reaches the weights.

* The decision is collective: each rank's "some micro-batch loss of this step is
  non-finite" flag is all-reduced (MAX) before the boundary `engine.step()`, so
  a NaN on one rank skips the step everywhere (ranks that disagreed would
  update their ZeRO partitions differently, or one would wait in a collective).
* The skip itself is DeepSpeed's own overflow path (the one fp16 loss scaling
  uses): the ZeRO optimizer is told "overflow" for this one step, so it zeroes
  the reduced gradient partitions, leaves weights and Adam moments untouched,
  and the engine counts `skipped_steps` and does not step the LR schedule.
  Applied from outside, per optimizer kind; nothing in DeepSpeed is edited.
* Gradient norms: ZeRO-1/2 get `check_grad_overflow` on (their inf/NaN scan of
  the gradient partitions, one all-reduce); ZeRO-3 skips on an invalid norm by
  itself. A step DeepSpeed skipped on its own is counted as "grad_norm".
* `--nan-policy fail`, or more than `nan_max_consecutive` skips in a row (the
  run has diverged; skipping forever would burn the allocation), raises
  NonFiniteLossError on every rank.

Test hook: LOONGFORGE_INJECT_NAN="S1,S2[@RANK]" multiplies the loss of steps
S1, S2 (on RANK only, default every rank) by NaN before backward, so real NaN
gradients flow through DeepSpeed's reduction.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from loongforge.shared.errors import TrainError

log = logging.getLogger(__name__)
INJECT_ENV = "LOONGFORGE_INJECT_NAN"


class NonFiniteLossError(TrainError):
    """Non-finite losses with --nan-policy fail, or too many in a row with skip."""


def parse_injection(text: str | None, rank: int) -> frozenset[int]:
    if not text:
        return frozenset()
    steps, _, only = text.partition("@")
    if only and int(only) != rank:
        return frozenset()
    return frozenset(int(s) for s in steps.split(",") if s.strip())


class NanGuard:
    def __init__(self, engine, *, policy: str, max_consecutive: int, rank: int, device: torch.device):
        self.engine, self.policy, self.max_consecutive = engine, policy, max_consecutive
        self.rank, self.device = rank, device
        self.inject = parse_injection(os.environ.get(INJECT_ENV), rank)
        self.skipped, self.consecutive = 0, 0
        self._bad = torch.zeros(1, device=device)
        opt = engine.optimizer
        if hasattr(opt, "check_grad_overflow"):  # ZeRO-1/2: scan the reduced gradient partitions too
            opt.check_grad_overflow = True

    def observe(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Per micro-batch, before backward: note a non-finite loss (no host sync); apply the test hook."""
        if step in self.inject:
            loss = loss * float("nan")
        self._bad = torch.maximum(self._bad, (~torch.isfinite(loss.detach())).float().reshape(1))
        return loss

    def step(self, step: int) -> str | None:
        """Run the boundary engine.step(); returns why it was skipped ("loss", "grad_norm") or None.
        One all-reduce and one host sync per optimizer step."""
        bad = self._bad.clone()
        self._bad.zero_()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        before = self.engine.skipped_steps
        forced = bool(bad.item())
        with (_forced_overflow(self.engine.optimizer) if forced else contextlib.nullcontext()):
            self.engine.step()
        if self.engine.skipped_steps == before:
            if forced:  # the optimizer kind ignored the overflow flag: the weights may hold NaN now
                raise NonFiniteLossError(f"step {step}: non-finite loss, and this optimizer "
                                         f"({type(self.engine.optimizer).__name__}) did not skip the update")
            self.consecutive = 0
            return None
        why = "loss" if forced else "grad_norm"
        self.skipped += 1
        self.consecutive += 1
        log.warning("step %d: non-finite %s on at least one rank: optimizer step skipped on every rank "
                    "(%d skipped so far, %d in a row)", step, why, self.skipped, self.consecutive)
        if self.policy == "fail" or self.consecutive > self.max_consecutive:
            limit = "--nan-policy fail" if self.policy == "fail" else \
                f"more than --nan-max-consecutive {self.max_consecutive} in a row"
            raise NonFiniteLossError(f"non-finite {why} at step {step} ({limit}); the weights are those of the "
                                     "last finite step: resume from a checkpoint with a lower --lr, or check "
                                     "the data of this step (metrics.jsonl sample_ids)")
        return why


@contextlib.contextmanager
def _forced_overflow(opt):
    """DeepSpeed's overflow path for one step, per optimizer kind (instance attributes, removed after)."""
    if hasattr(opt, "_overflow_check_and_loss_scale_update"):  # ZeRO-3
        def forced(update_scale=True):
            opt.overflow = True
            return opt._loss_scale_update_and_overflow_cleanup() if update_scale else True
        patches = {"_overflow_check_and_loss_scale_update": forced}
    elif hasattr(opt, "check_grad_overflow"):  # ZeRO-1/2: step() zeroes the partitions and returns
        patches = {"has_overflow": lambda partition_gradients=True: True}
    else:  # ZeRO-0: the engine zeroes the module's gradients after a step it counts as skipped
        patches = {"step": lambda *a, **k: None, "overflow": True}
    saved_flag = getattr(opt, "check_grad_overflow", None)
    if saved_flag is not None:
        opt.check_grad_overflow = True
    for k, v in patches.items():
        setattr(opt, k, v)
    try:
        yield
    finally:
        for k in patches:
            with contextlib.suppress(AttributeError):
                delattr(opt, k)
        if saved_flag is not None:
            opt.check_grad_overflow = saved_flag
