"""The one ordered step that turns a built model into a training engine, from outside the model.

    parallelize(build, cfg, state, device=...)
      construct   build() (under deepspeed.zero.Init for plain ZeRO-3, see below)
      1. TP       the attention and MLP linears of the vision tower, LLM and DiT swapped for
                  column/row-parallel shards (tensor_parallel.py)
      2. SP       images split over the SP group before the vision tower, the LLM's image tokens
                  sharded with Ulysses attention (video_sp.py)
      3. FP8      linears swapped for torchao Float8Linear (kernels/precision.py); dropout for
                  per-sample dropout, its masks a function of (seed, epoch, sample id) (kernels/dropout.py)
      4. fusion   block forwards compiled; --cuda-graphs: reduce-overhead graphs (kernels/fusion.py, graphs.py)
      5. AC       activation checkpointing of every Nth block (kernels/checkpointing.py)
      6. ZeRO     hybrid ZeRO-3 partitioned over the shard group, deepspeed.initialize (mpu = the plan,
                  the LR schedule of lr_schedule.py),
                  then the checkpoint writers of hybrid sharding and its compressed replica sync
    -> ParallelModel(engine, ds_config, policies, dp_sync)

Why `build` is a factory, not a model: plain ZeRO-3 (no TP, SP or hybrid sharding) constructs the
model inside deepspeed.zero.Init, which partitions each module's parameters as it is created, so
no rank ever holds the full fp32 model (~11.9 GB for N1.6's 2.96 B parameters); steps 3-5 then run
on the partitioned modules, as they always have. A TP/SP/hybrid run instead builds the full,
identically seeded model on every rank (so TP starts from the single-process initialisation),
cuts its shards, and ZeRO-3 partitions the result over the shard group in step 6 (one transient
full fp32 copy per rank).

None of the steps renames a parameter or inserts a wrapper module, so checkpoints load across
settings and ZeRO partitions the same tensors. The model file knows nothing of any of this.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.config import TrainConfig
from loongforge.train.kernels import graphs
from loongforge.train.kernels.checkpointing import apply_ac
from loongforge.train.kernels.dropout import SampleKeys, apply_sample_dropout
from loongforge.train.kernels.fusion import apply_fusion, fusion_wanted
from loongforge.train.kernels.precision import Fp8Warmup, convert_fp8
from loongforge.train.parallel import comm
from loongforge.train.parallel.engine import ds_config
from loongforge.train.parallel.lr_schedule import LRSchedule
from loongforge.train.parallel.plan import ParallelState, is_hybrid
from loongforge.train.parallel.sequence_parallel import SequenceParallel
from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
from loongforge.train.parallel.video_sp import apply_video_sequence_parallel
from loongforge.train.parallel.zero import (CompressedDPSync, keep_vectors_gathered, partition_zero3,
                                            zero_loss_scale)

log = logging.getLogger(__name__)


class MemoryPolicies:
    """What steps 3-5 applied, and their per-step hooks: `on_step(step)` at the top of every
    optimizer step (the FP8 warm-up schedule), `before_forward()` at the top of every micro-step."""

    def __init__(self, checkpointed: list[str], fp8_linears: list[str], warmup=None, fused=(), graphed=False,
                 dropout: SampleKeys | None = None, dropouts=()):
        self.checkpointed, self.fp8_linears, self.warmup, self.fused = checkpointed, fp8_linears, warmup, list(fused)
        self.graphed = graphed
        self.dropout, self.dropouts = dropout, list(dropouts)  # per-sample dropout: its keys, the swapped modules

    def set_sample_keys(self, keys, device=None) -> None:
        """The micro-batch's per-sample keys (kernels/dropout.sample_keys): every dropout mask follows them."""
        if self.dropout is not None:
            self.dropout.set(keys, device)

    def on_step(self, step: int) -> None:
        if self.warmup is not None:
            self.warmup.on_step(step)

    def before_forward(self) -> None:
        if self.graphed:
            graphs.mark_step_begin()  # --cuda-graphs: a new CUDA graph tree iteration


@dataclass(frozen=True)
class ParallelModel:
    engine: object  # deepspeed.DeepSpeedEngine; engine.module is the model
    ds_config: dict
    policies: MemoryPolicies
    dp_sync: CompressedDPSync | None  # --grad-compression topk: call between backward and step


def parallelize(build: Callable[[], nn.Module], cfg: TrainConfig, state: ParallelState, *,
                device: torch.device, build_full: bool = False) -> ParallelModel:
    """Construct the model with `build` and apply steps 1-6 of the module docstring, in that order.
    `build_full`: construct the whole model even under plain ZeRO-3 (a build that loads checkpoint
    weights), then partition it, as a TP/SP run does."""
    import deepspeed  # heavy: only a process that trains pays its import

    conf = ds_config(cfg, world=state.get_data_parallel_world_size(), device=device)
    hybrid = is_hybrid(state)
    with _construction(conf, hybrid or build_full):
        model = build()
        apply_tp(model, state)  # 1
        apply_sp(model, state, conf)  # 2
        policies = apply_memory_policies(model, cfg, device)  # 3-5
    if (hybrid or build_full) and conf["zero_optimization"]["stage"] == 3:  # 6
        partition_zero3(model, state, conf)  # over the shard group, never the pure DP group
    keep_vectors_gathered(conf, model)  # ZeRO-3: norms and biases persist
    # The optimizer (and ZeRO's gradient and optimizer-state partitions) hold the trainable parameters
    # only: a fine-tune that freezes the vision tower and most of the LLM keeps no state for them.
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("model: no parameter trains (every --tune-* switch is off); turn one on")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=conf,
                                           mpu=state if hybrid else None,
                                           lr_scheduler=LRSchedule.factory(cfg.optim, cfg.run.steps))
    if state.plan.zero_shard == "sp" and state.get_data_parallel_rank() != 0:
        # Hybrid sharding: DeepSpeed picks its checkpoint writers by rank in the shard group, so every DP
        # replica would write the same zero_pp_rank_* / mp_rank_* files and race on them; replica 0 writes
        # them, the others only their per-rank files (RNG, compression residuals).
        engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
    name_engine_groups(engine, world_is_dp=not hybrid)
    return ParallelModel(engine=engine, ds_config=conf, policies=policies,
                         dp_sync=CompressedDPSync.for_config(cfg, state, engine))


def _construction(conf: dict, hybrid: bool):
    """deepspeed.zero.Init for plain ZeRO-3 (module docstring), else nothing."""
    if conf["zero_optimization"]["stage"] != 3 or hybrid:
        return contextlib.nullcontext()
    import deepspeed  # heavy, as in parallelize

    return deepspeed.zero.Init(config_dict_or_path=conf)


def apply_tp(model: nn.Module, state: ParallelState) -> int:
    swapped = apply_tensor_parallel(model, state)
    if state.plan.tp > 1 and swapped == 0:
        raise ConfigError(f"parallel.tp={state.plan.tp}: no attention or MLP block of the tensor-parallel plan to "
                          "split (a module swap replaced them?); use --tp 1")
    return swapped


def apply_sp(model: nn.Module, state: ParallelState, conf: dict) -> list:
    """Images split before the vision tower, the LLM's image tokens sharded (Ulysses), the loss gradient
    seeded for ZeRO's divisor over SP (video_sp.py)."""
    if state.plan.sp == 1:
        return []
    return apply_video_sequence_parallel(model, SequenceParallel(state),
                                         zero_divisor=zero_loss_scale(conf["zero_optimization"], state))


def apply_memory_policies(model: nn.Module, cfg: TrainConfig, device: torch.device) -> MemoryPolicies:
    """Steps 3-5: FP8 swap, fusion (or CUDA graphs), activation checkpointing; the checkpoint wraps
    the compiled forward, so fusion comes first."""
    m = cfg.memory
    fp8, warmup = [], None
    if m.fp8:
        fp8 = convert_fp8(model, recipe=m.fp8_recipe, min_features=m.fp8_min_features, device=device)
        warmup = Fp8Warmup(model, m.fp8_warmup_steps, m.fp8_warmup_mode)
        log.info("fp8 (%s): %d linears converted, warm-up %d steps (%s)", m.fp8_recipe, len(fp8),
                 m.fp8_warmup_steps, m.fp8_warmup_mode)
    keys, dropouts = apply_sample_dropout(model)
    if dropouts:
        log.info("dropout: %d modules draw per-sample masks (a function of seed, epoch and sample id)", len(dropouts))
    fused = []
    if m.cuda_graphs:
        graphs.check(device=device, zero_stage=cfg.parallel.zero_stage, ac_every=m.ac_every, tp=cfg.parallel.tp)
        fused = apply_fusion(model, **graphs.compile_options(m.fuse))
        graphs.own_grads(model)
        log.info("cuda graphs: torch.compile(%s) of %d block forwards", graphs.compile_options(m.fuse), len(fused))
    elif fusion_wanted(m.fuse, device, cfg.parallel.zero_stage, model_parallel=cfg.parallel.tp * cfg.parallel.sp):
        fused = apply_fusion(model)
        log.info("fusion: torch.compile of %d block forwards", len(fused))
    ckpt = apply_ac(model, m.ac_every)
    if m.ac_every:
        log.info("activation checkpointing every %d blocks: %d blocks (%s)", m.ac_every, len(ckpt),
                 ", ".join(ckpt[:4]) + (" ..." if len(ckpt) > 4 else ""))
    return MemoryPolicies(ckpt, fp8, warmup, fused, graphed=m.cuda_graphs, dropout=keys, dropouts=dropouts)


def name_engine_groups(engine, *, world_is_dp: bool = False) -> None:
    """Without an mpu DeepSpeed builds its own data-parallel groups: name them "dp" for the counter.
    A plain run (`world_is_dp`: no TP/SP/compression, no mpu) is data parallel over every rank, and
    ZeRO-3 gathers parameters and reduce-scatters gradients over the world group itself: that is the
    DP traffic, so the world group is named "dp" too, the name the compressed DP sync's traffic has."""
    for pg in (getattr(engine, "data_parallel_group", None), getattr(engine, "seq_data_parallel_group", None)):
        if pg is not None and comm.group_name(pg) == "other":
            comm.register_group(pg, "dp")
    if world_is_dp and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        comm.register_group(torch.distributed.group.WORLD, "dp")
