"""The NaN guard with bf16, in one real gloo rank: a skipped step must leave no NaN gradient behind
in the optimizer's gradient buffers, or the next finite step would apply it. DeepSpeed 0.19.8
wraps bf16 at ZeRO-0 in FP16_UnfusedOptimizer and at ZeRO-1 in DeepSpeedZeroOptimizer (the
trainer's configs); BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation) clears its fp32
accumulators only inside its own step, which the guard turns into a no-op, but the engine calls
the optimizer's zero_grad after every step, skipped or not, and that clears them too. This test
holds DeepSpeed to that for all three."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.train.parallel.dist_helpers import run_ranks


def _engine(seed: int, stage: int, fp32_accum: bool):
    import deepspeed

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    conf = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 1 << 30}
    if fp32_accum:
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    return engine


def _train(engine, guard, step: int, x: torch.Tensor, nan: bool) -> str | None:
    loss = engine(x).float().pow(2).mean()
    if nan:
        guard.inject = frozenset({step})
    loss = guard.observe(step, loss)
    engine.backward(loss)
    return guard.step(step)


def _worker(rank: int, world: int) -> None:
    import deepspeed

    from loongforge.train.parallel.engine import align_ds_accelerator, skip_cpu_shm_op

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    align_ds_accelerator(torch.device("cpu"))
    skip_cpu_shm_op(deepspeed)
    kinds = [_check(stage, fp32) for stage, fp32 in ((0, False), (1, False), (1, True))]
    # The wrappers this test covers; another one (a DeepSpeed upgrade) needs its own look.
    assert kinds == ["FP16_UnfusedOptimizer", "DeepSpeedZeroOptimizer", "BF16_Optimizer"], kinds


def _check(stage: int, fp32_accum: bool) -> str:
    from loongforge.train.resilience.nan_guard import NanGuard

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    guarded, plain = _engine(0, stage, fp32_accum), _engine(0, stage, fp32_accum)
    guard = NanGuard(guarded, policy="skip", max_consecutive=3, rank=0, device=torch.device("cpu"))
    ref = NanGuard(plain, policy="skip", max_consecutive=3, rank=0, device=torch.device("cpu"))
    assert guard.on_device  # DeepSpeed's own gradient check skips the step: no host read in the guard
    assert _train(guarded, guard, 0, x, nan=True) is True and guard.reason(True, bool(guard.flag)) == "loss"
    kind = type(guarded.optimizer).__name__
    assert _train(guarded, guard, 1, x, nan=False) is False and _train(plain, ref, 1, x, nan=False) is False
    for a, b in zip(guarded.module.parameters(), plain.module.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), kind  # the skipped step left nothing behind
    return kind


def test_bf16_zero0_skipped_step_carries_no_nan_into_the_next_update():
    run_ranks(_worker, 1, timeout=240)
