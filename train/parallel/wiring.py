"""Where the trainer meets the parallel plan: the few calls trainer.py / engine.py /
preflight.py make, so that those files only gain a line each.

Order of one rank's start (README "Groups and placement"):
    preflight: check_layout (world % (tp*sp), heads % tp) -> DP size, before any group
    init_distributed -> initialize (every group, once; placement table on rank 0)
    build_model: construct (identically seeded full weights) -> apply_tensor_parallel
                 -> apply_video_sequence_parallel (S > 1: video tokens split at model.trunk_tokens)
                 -> ZeRO-3: partition over the shard group (zero.partition_zero3)
    deepspeed.initialize(mpu=state)  (engine.build_engine)
    loader keyed by the DP coordinate: the T ranks of a TP group read the same batch (they
    compute one replica together); the noise is per sample (trainer.noise_for), so theirs agree.

A plain run (tp = sp = 1) still builds its groups (the communication counter names
them), but DeepSpeed gets no mpu and the model is built exactly as before: that
path stays byte-identical to the trainer without a plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.train.config import ModelConfig, TrainConfig
from loongforge.train.parallel import plan as plan_mod
from loongforge.train.parallel.plan import ParallelPlan, ParallelState


def plan_of(cfg: TrainConfig) -> ParallelPlan:
    p = cfg.parallel
    return ParallelPlan(tp=p.tp, sp=p.sp, zero_shard="sp" if p.grad_compression == "topk" else "sp_dp")


def check_layout(cfg: TrainConfig, world: int, model_cfg: ModelConfig) -> int:
    """Preflight (no process group): the layout fits the world and the model. Returns the DP size."""
    p = plan_of(cfg)
    dp = p.dp(world)  # ConfigError when world % (tp*sp) != 0
    p.check_model(heads=model_cfg.heads)
    mem = getattr(cfg, "memory", None)
    if p.sp > 1 and mem is not None and getattr(mem, "cuda_graphs", False):
        # NOTE: a captured block would replay the Ulysses all-to-alls of the batch it was captured on.
        raise ConfigError(f"parallel.sp={p.sp}: --cuda-graphs is not combined with sequence parallelism; "
                          "drop it or use --sp 1")
    if p.tp * p.sp > 1 and mem is not None and (mem.fp8 or mem.fuse == "on"):
        # NOTE: the memory policies run inside make_model, before the TP swap and the SP hooks: the swap
        # would replace torchao's Float8Linear by plain shards, and fusion is untested around the TP
        # collectives and the Ulysses all-to-alls.
        raise ConfigError(f"parallel.tp={p.tp} sp={p.sp}: --fp8 and --fuse on are not combined with tensor or "
                          "sequence parallelism yet; drop them or use --tp 1 --sp 1")
    hidden = int(model_cfg.dim * model_cfg.mlp_ratio)
    if hidden % p.tp:
        raise ConfigError(f"parallel.tp={p.tp}: the MLP hidden size {hidden} (model.dim x mlp_ratio) is not "
                          "divisible by tp; pick a tp that divides it")
    return dp


def initialize(cfg: TrainConfig) -> ParallelState:
    """All groups of the plan, once, right after init_distributed (collective on every rank)."""
    return plan_mod.initialize(plan_of(cfg), verbose=True)


def is_hybrid(state: ParallelState | None) -> bool:
    return state is not None and (state.plan.tp * state.plan.sp > 1 or state.plan.zero_shard != "sp_dp")


def build_model(make_model: Callable[[], torch.nn.Module], conf: dict, state: ParallelState):
    """(model, mpu) for engine.build_engine. With TP every rank first builds the full, identically
    seeded model and cuts its shards from it (tensor_parallel.py), so a TP run starts from the
    single-process initialisation; under ZeRO-3 the swapped model is then partitioned over the
    shard group (zero.partition_zero3), never over the pure DP group.
    NOTE: that is one full fp32 copy per rank before partitioning, unlike the plain ZeRO-3 path
    (zero.Init at construction); for the 1.6b recipe ~6.4 GB of host memory per rank, transient."""
    from loongforge.train.parallel.engine import construct_model
    from loongforge.train.parallel.sequence_parallel import SequenceParallel
    from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
    from loongforge.train.parallel.video_sp import apply_video_sequence_parallel
    from loongforge.train.parallel.zero import partition_zero3, zero_loss_scale

    if not is_hybrid(state):
        return construct_model(make_model, conf), None
    model = make_model()
    swapped = apply_tensor_parallel(model, state)
    if state.plan.tp > 1 and swapped == 0:
        raise ConfigError(f"parallel.tp={state.plan.tp}: no block with nn.Linear qkv/proj/fc1/fc2 to split "
                          "(a module swap replaced them?); use --tp 1")
    if state.plan.sp > 1:  # video tokens sharded at model.trunk_tokens, the loss gradient seeded for ZeRO over SP
        apply_video_sequence_parallel(model, SequenceParallel(state),
                                      zero_divisor=zero_loss_scale(conf["zero_optimization"], state))
    if conf["zero_optimization"]["stage"] == 3:
        partition_zero3(model, state)
    return model, state


def data_coords(state: ParallelState) -> tuple[int, int]:
    """(rank, world) of the data loader: the DP coordinate."""
    return state.get_data_parallel_rank(), state.get_data_parallel_world_size()


def replica_ranks(state: ParallelState, world: int) -> list[int]:
    """One global rank per DP replica (tp = sp = 0), in DP order: the rows of a step's gathered
    losses and sample ids that are not copies (TP ranks of one replica hold the same ones)."""
    p = state.plan
    return [p.rank_of(0, 0, d) for d in range(p.dp(world))]


def layout(state: ParallelState) -> dict:
    """Recorded in the checkpoint sidecar and the metrics lines."""
    return {"tp": state.plan.tp, "sp": state.plan.sp}


def check_resume_layout(sidecar: dict, state: ParallelState, tag: str, world: int | None = None, *,
                        run_dir: str = "RUN", zero_stage: int | None = None) -> None:
    """Model and ZeRO files are cut per TP rank (mp_rank_XX): a different layout cannot load them as they
    are; `loongforge ckpt reshard` converts them (ckpt_reshard.py), and the message names its command."""
    saved = {"tp": 1, "sp": 1, **sidecar.get("parallel", {})}
    w = world if world is not None else sidecar.get("world", 1)
    z = zero_stage if zero_stage is not None else sidecar.get("zero_stage", 2)
    fix = f"loongforge ckpt reshard {run_dir} --to world={w},zero={max(int(z), 1)},tp={state.plan.tp}" + \
        (f",sp={state.plan.sp}" if state.plan.sp > 1 else "")
    if is_hybrid(state) and world is not None and sidecar.get("world", world) != world:
        raise CheckpointError(f"checkpoint {tag} was written by {sidecar['world']} ranks, this run has {world}: "
                              "with --tp/--sp/--grad-compression a resume on another rank count needs the "
                              f"checkpoint converted first: {fix}")
    if saved != layout(state):
        raise CheckpointError(f"checkpoint {tag} was written with tp={saved['tp']} sp={saved['sp']}, this run has "
                              f"tp={state.plan.tp} sp={state.plan.sp}: its tensor-parallel shards do not fit; "
                              f"convert it first: {fix} (or resume with the same --tp/--sp)")


def after_engine(engine, state: ParallelState) -> None:
    """Once deepspeed.initialize returned. Hybrid sharding (ZeRO inside SP): DeepSpeed picks its
    checkpoint writers by rank in the shard group, so every DP replica would write the same
    zero_pp_rank_* / mp_rank_* files and race on them; replica 0 writes them, the others only
    their per-rank files (RNG, compression residuals). Then name DeepSpeed's groups for the counter."""
    if state.plan.zero_shard == "sp" and state.get_data_parallel_rank() != 0:
        engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
    name_engine_groups(engine)


def name_engine_groups(engine) -> None:
    """Without an mpu DeepSpeed builds its own data-parallel groups: name them "dp" for the counter
    (a group that is the world keeps the name "world")."""
    from loongforge.train.parallel import comm

    for pg in (getattr(engine, "data_parallel_group", None), getattr(engine, "seq_data_parallel_group", None)):
        if pg is not None and comm.group_name(pg) == "other":
            comm.register_group(pg, "dp")


class StepComm:
    """Every collective of each training step, by group kind (tp / sp / dp / sp_dp / world): the
    parallel modules' own and DeepSpeed's, through comm.patch_torch_distributed, installed once
    for the run. `begin()` at the start of a step drops whatever ran between steps (metric
    gathers, checkpoint saves, evaluation); `end()` returns this rank's
    {group: {calls, payload_bytes, wire_bytes, seconds}}. Host-side bookkeeping only, no device
    sync: on NCCL `seconds` is the launch time, the kernel time is in the profiler trace."""

    def __init__(self):
        from loongforge.train.parallel import comm

        self._counter = comm.CommCounter()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(comm.patch_torch_distributed(self._counter))

    def begin(self) -> None:
        for d in (self._counter.calls, self._counter.payload, self._counter.wire, self._counter.seconds):
            d.clear()
        self._counter.steps = 0

    def end(self) -> dict:
        self._counter.step()
        return {g: {k: round(v, 6) for k, v in row.items()} for g, row in self._counter.by_group().items()}

    def close(self) -> None:
        self._stack.close()


class CompressedDPSync:
    """Hybrid sharding's replica sync, called between engine.backward() and engine.step(): at the
    accumulation boundary ZeRO-3 has reduced the gradients inside the shard group, and each rank's
    partition is averaged with the other DP replicas' by top-k + error feedback (zero.py). The
    residuals are per rank and saved beside the checkpoint, so a resume is exact."""

    def __init__(self, cfg: TrainConfig, state: ParallelState, engine):
        import torch.distributed as dist

        from loongforge.train.parallel.compression import CompressionConfig, TopKCompressor

        self.engine, self.rank = engine, dist.get_rank()
        self.compressor = TopKCompressor(CompressionConfig(wire_fraction=1.0 / cfg.parallel.compress_ratio),
                                         state.group("dp"))

    def __call__(self) -> None:
        from loongforge.train.parallel.zero import compressed_dp_sync

        if self.engine.is_gradient_accumulation_boundary():
            compressed_dp_sync(self.engine.module, self.compressor)

    def _name(self) -> str:
        return f"compressor_rank{self.rank}.pt"

    def blobs(self) -> tuple[tuple[str, bytes], ...]:
        """This rank's residuals for the checkpoint writer (checkpoint.Checkpointer.save(blobs=...)):
        written and hashed with the rest of the tag, before the `latest` pointer moves."""
        import io

        buf = io.BytesIO()
        torch.save(self.compressor.state_dict(), buf)
        return ((self._name(), buf.getvalue()),)

    def load(self, run_dir: str, tag: str) -> None:
        import os

        from loongforge.train.ckpt import checkpoint

        path = os.path.join(checkpoint.ckpt_root(run_dir), tag, self._name())
        try:
            # NOTE: to the host first: residuals written from cuda:3 would otherwise be restored to
            # cuda:3, which a resuming rank that sees one GPU (or its GPU under another index) lacks;
            # the compressor moves them to the gradients' device on first use.
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path} missing: the checkpoint was written without --grad-compression topk "
                                  "(or by another rank count); resume with the flags that wrote it") from None
        self.compressor.load_state_dict(sd)


def dp_sync(cfg: TrainConfig, state: ParallelState, engine) -> CompressedDPSync | None:
    return CompressedDPSync(cfg, state, engine) if cfg.parallel.grad_compression == "topk" else None
