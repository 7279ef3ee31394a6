"""NaN guard: a non-finite loss (or gradient norm) skips the optimizer step on
every rank, is counted in metrics.jsonl, and never reaches the weights.

* The decision is collective and made on the device: a non-finite loss is multiplied by NaN
  before backward, so every gradient of that backward is NaN (NaN x 0 too); DeepSpeed's gradient
  reduction carries them to every rank, and its own non-finite check of the reduced gradients
  (the one fp16 loss scaling uses, which its step reads on the host anyway) skips the update
  everywhere: ZeRO-1/2 with `check_grad_overflow` on, ZeRO-3 on an invalid norm, the bf16 wrappers
  at ZeRO-0/1 on an invalid norm. It zeroes the reduced gradient partitions, leaves weights and
  Adam moments untouched, counts `skipped_steps` and does not step the LR schedule. So the guard
  adds no host sync to the step: why a step was skipped (a rank's loss, or a gradient norm alone)
  is read one step late, with the step's log record (`flag`, trainer._write_record).
* An optimizer DeepSpeed does not check (a plain torch one: ZeRO-0 in fp32) keeps the host-side
  decision: each rank's flag all-reduced (MAX) and read before `engine.step()`, the overflow path
  forced from outside (one host sync per step, on that path only).
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
        self.flag = torch.zeros(1, device=device)  # the last optimizer step's: 1 if a loss of this rank was non-finite
        opt = engine.optimizer
        if hasattr(opt, "check_grad_overflow"):  # ZeRO-1/2: scan the reduced gradient partitions too
            opt.check_grad_overflow = True
        self.on_device = deepspeed_checks_gradients(opt)

    def observe(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Per micro-batch, before backward: note a non-finite loss and, where DeepSpeed checks the
        gradients, make every gradient of it non-finite (on the device: no host sync); the test hook."""
        if step in self.inject:
            loss = loss * float("nan")
        bad = ~torch.isfinite(loss.detach())
        self._bad = torch.maximum(self._bad, bad.float().reshape(1))
        if self.on_device:
            # NOTE: a loss can be non-finite through a term no parameter reaches, its gradients finite;
            # times NaN every gradient is NaN. Times 1 otherwise: the same loss and gradients, bit for bit.
            loss = loss * torch.where(bad, float("nan"), 1.0).to(loss.dtype)
        return loss

    def step(self, step: int) -> bool:
        """Run the boundary engine.step(); returns whether it was skipped (on every rank alike)."""
        self.flag, self._bad = self._bad, torch.zeros_like(self._bad)
        before = self.engine.skipped_steps
        if self.on_device:
            self.engine.step()
        else:
            self._step_host_decided(step)
        if self.engine.skipped_steps == before:
            self.consecutive = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        log.warning("step %d: non-finite loss or gradient norm on at least one rank: optimizer step skipped on "
                    "every rank (%d skipped so far, %d in a row)", step, self.skipped, self.consecutive)
        if self.policy == "fail" or self.consecutive > self.max_consecutive:
            limit = "--nan-policy fail" if self.policy == "fail" else \
                f"more than --nan-max-consecutive {self.max_consecutive} in a row"
            raise NonFiniteLossError(f"non-finite loss or gradient norm at step {step} ({limit}); the weights are "
                                     "those of the last finite step: resume from a checkpoint with a lower --lr, or "
                                     "check the data of this step (metrics.jsonl sample_ids)")
        return True

    def _step_host_decided(self, step: int) -> None:
        bad = self.flag.clone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        before = self.engine.skipped_steps
        forced = bool(bad.item())  # the host sync of this path (an optimizer DeepSpeed does not check)
        with (_forced_overflow(self.engine.optimizer) if forced else contextlib.nullcontext()):
            self.engine.step()
        if forced and self.engine.skipped_steps == before:  # the weights may hold NaN now
            raise NonFiniteLossError(f"step {step}: non-finite loss, and this optimizer "
                                     f"({type(self.engine.optimizer).__name__}) did not skip the update")

    @staticmethod
    def reason(skipped: bool, nonfinite_loss: bool) -> str | None:
        """Why a step was skipped, for its log record: a rank's loss, or DeepSpeed's gradient check alone.
        `nonfinite_loss`: any rank's `flag` of that step."""
        if not skipped:
            if nonfinite_loss:
                raise NonFiniteLossError("a non-finite loss did not skip its optimizer step: the weights may hold "
                                         "NaN; resume from the last checkpoint")
            return None
        return "loss" if nonfinite_loss else "grad_norm"


def deepspeed_checks_gradients(opt) -> bool:
    """Does this DeepSpeed optimizer skip a step with non-finite gradients by itself (0.19.8)?"""
    return (hasattr(opt, "_overflow_check_and_loss_scale_update")  # ZeRO-3: invalid norm
            or hasattr(opt, "check_grad_overflow")  # ZeRO-1/2, turned on by the guard
            or hasattr(opt, "overflow_checker")  # FP16_UnfusedOptimizer (bf16 at ZeRO-0)
            or type(opt).__name__ == "BF16_Optimizer")  # bf16 at ZeRO-1 with fp32 accumulation: invalid norm


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
