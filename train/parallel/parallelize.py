"""The one place where memory and precision policies meet the model, before the engine.

`apply_memory_policies(model, cfg, device)` runs between building the model
and deepspeed.initialize: FP8 swaps linears (same parameters, so ZeRO sees
them as before), fusion compiles block forwards (CUDA, ZeRO < 3), then
activation checkpointing wraps them. The
trainer calls `on_step(step)` at the top of every optimizer step (the FP8
warm-up schedule). The model file knows nothing of either.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loongforge.train.config import TrainConfig

log = logging.getLogger(__name__)


class MemoryPolicies:
    def __init__(self, checkpointed: list[str], fp8_linears: list[str], warmup=None, fused=(), graphed=False):
        self.checkpointed, self.fp8_linears, self.warmup, self.fused = checkpointed, fp8_linears, warmup, list(fused)
        self.graphed = graphed

    def on_step(self, step: int) -> None:
        if self.warmup is not None:
            self.warmup.on_step(step)

    def before_forward(self) -> None:
        """Top of every micro-step (--cuda-graphs: a new CUDA graph tree iteration)."""
        if self.graphed:
            from loongforge.train.kernels.graphs import mark_step_begin

            mark_step_begin()


def apply_memory_policies(model: nn.Module, cfg: TrainConfig, device: torch.device) -> MemoryPolicies:
    from loongforge.train.kernels.fusion import apply_fusion, fusion_wanted
    from loongforge.train.kernels.checkpointing import apply_ac

    m = cfg.memory
    fp8, warmup = [], None
    if m.fp8:
        from loongforge.train.kernels.precision import Fp8Warmup, convert_fp8

        fp8 = convert_fp8(model, recipe=m.fp8_recipe, min_features=m.fp8_min_features, device=device)
        warmup = Fp8Warmup(model, m.fp8_warmup_steps, m.fp8_warmup_mode)
        log.info("fp8 (%s): %d linears converted, warm-up %d steps (%s)", m.fp8_recipe, len(fp8),
                 m.fp8_warmup_steps, m.fp8_warmup_mode)
    fused = []
    if m.cuda_graphs:
        from loongforge.train.kernels import graphs

        graphs.check(device=device, zero_stage=cfg.parallel.zero_stage, ac_every=m.ac_every, tp=cfg.parallel.tp)
        fused = apply_fusion(model, **graphs.compile_options(m.fuse))
        graphs.own_grads(model)
        log.info("cuda graphs: torch.compile(%s) of %d block forwards", graphs.compile_options(m.fuse), len(fused))
    elif fusion_wanted(m.fuse, device, cfg.parallel.zero_stage):
        fused = apply_fusion(model)  # before AC: the checkpoint wraps the compiled forward
        log.info("fusion: torch.compile of %d block forwards", len(fused))
    ckpt = apply_ac(model, m.ac_every)
    if m.ac_every:
        log.info("activation checkpointing every %d blocks: %d blocks (%s)", m.ac_every, len(ckpt),
                 ", ".join(ckpt[:4]) + (" ..." if len(ckpt) > 4 else ""))
    return MemoryPolicies(ckpt, fp8, warmup, fused, graphed=m.cuda_graphs)
