"""The parallel plan: every process group of a TP x SP x DP run, built once, here.

Rank placement (documented order, Megatron's convention):

    rank = dp * (S * T) + sp * T + tp        TP innermost, SP next, DP outermost

so the T ranks of a TP group are consecutive (same node: TP talks every layer,
twice per block, on the critical path), an SP group spans T*S consecutive ranks
(one node for T*S <= GPUs per node: Ulysses all-to-alls stay on NVLink), and
only the DP dimension crosses nodes (gradient sync, once per step, overlappable).

Groups (each rank is in exactly one of each kind):
    tp        same (dp, sp)   tensor-parallel collectives of the linears
    sp        same (dp, tp)   Ulysses all-to-all of the video tokens
    dp        same (sp, tp)   replicas holding different samples
    sp_dp     same tp         ZeRO shards parameters/grads/optimizer state here:
                              SP ranks see different tokens of the same sample,
                              so their gradients must be summed like DP's.
                              (zero_shard="sp": ZeRO inside sp only, hybrid
                              sharding, DP replicas synced by compression.py.)
DeepSpeed reads these through `ParallelState` (its `mpu` interface). The mpu
deliberately has no `initialize_sequence_parallel`: DeepSpeed takes its presence
as "Ulysses-only mpu" and then drops the model-parallel (TP) group from the
ZeRO gradient norm (zero/stage3.py, stage_1_and_2.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from loongforge.shared.errors import ConfigError
from loongforge.train.config import TrainConfig
from loongforge.train.model.config import GrootConfig
from loongforge.train.parallel import comm


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    tp: int = 1  # tensor-parallel degree (heads and MLP hidden are split T ways)
    sp: int = 1  # sequence-parallel degree over video tokens (Ulysses: heads split S ways in attention)
    # What ZeRO shards over (the mpu's sequence-data-parallel group): "sp_dp" = every rank of one
    # TP coordinate; "sp" = hybrid sharding, ZeRO inside the SP group and the DP replicas synced
    # by the top-k compressor (compression.py), which ZeRO's own reduce path cannot host.
    zero_shard: str = "sp_dp"

    def __post_init__(self):
        if self.tp < 1:
            raise ConfigError(f"parallel.tp={self.tp}: must be >= 1")
        if self.sp < 1:
            raise ConfigError(f"parallel.sp={self.sp}: must be >= 1")
        if self.zero_shard not in ("sp_dp", "sp"):
            raise ConfigError(f"parallel.zero_shard={self.zero_shard!r}: use 'sp_dp' (ZeRO over SP x DP) or 'sp' "
                              "(ZeRO inside SP, compressed sync across DP replicas)")

    def dp(self, world: int) -> int:
        if world % (self.tp * self.sp):
            raise ConfigError(f"parallel: world size {world} is not divisible by tp*sp = {self.tp}*{self.sp}; "
                              "pick --tp/--sp whose product divides the number of ranks")
        return world // (self.tp * self.sp)

    def check_model(self, *, heads: int) -> None:
        """Heads are split T ways by TP and then S ways by Ulysses."""
        if heads % (self.tp * self.sp):
            raise ConfigError(f"parallel: model.heads={heads} is not divisible by tp*sp = {self.tp * self.sp}; "
                              "choose heads as a multiple of tp*sp")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (tp, sp, dp) coordinates."""
        return rank % self.tp, (rank // self.tp) % self.sp, rank // (self.tp * self.sp)

    def rank_of(self, tp: int, sp: int, dp: int) -> int:
        return dp * self.sp * self.tp + sp * self.tp + tp

    def group_ranks(self, world: int) -> dict[str, list[list[int]]]:
        """Every group of every kind, as lists of global ranks, in a fixed order (new_group is collective)."""
        t, s, d = self.tp, self.sp, self.dp(world)
        return {
            "tp": [[self.rank_of(i, j, k) for i in range(t)] for k in range(d) for j in range(s)],
            "sp": [[self.rank_of(i, j, k) for j in range(s)] for k in range(d) for i in range(t)],
            "dp": [[self.rank_of(i, j, k) for k in range(d)] for j in range(s) for i in range(t)],
            "sp_dp": [[self.rank_of(i, j, k) for k in range(d) for j in range(s)] for i in range(t)],
        }

    def placement_table(self, world: int) -> str:
        lines = [f"parallel plan: world={world} tp={self.tp} sp={self.sp} dp={self.dp(world)} "
                 "(rank = dp*sp*tp + sp*tp + tp; TP innermost)", "rank  tp  sp  dp"]
        lines += [f"{r:>4} {c[0]:>3} {c[1]:>3} {c[2]:>3}" for r in range(world) for c in [self.coords(r)]]
        return "\n".join(lines)


class ParallelState:
    """The built groups of one plan; also the `mpu` DeepSpeed calls."""

    def __init__(self, plan: ParallelPlan, groups: dict, ranks: dict[str, list[int]]):
        self.plan, self._groups, self._ranks = plan, groups, ranks

    def group(self, kind: str):
        return self._groups[kind]

    def ranks(self, kind: str) -> list[int]:
        return list(self._ranks[kind])

    def rank_in(self, kind: str) -> int:
        return self._ranks[kind].index(dist.get_rank())

    def size(self, kind: str) -> int:
        return len(self._ranks[kind])

    # --- DeepSpeed mpu interface (runtime/engine.py, utils/groups.py, zero/) ---
    def get_tensor_model_parallel_group(self):
        return self._groups["tp"]

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank_in("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ranks["tp"][0]

    # No pipeline parallelism: the model-parallel group is the TP group.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self):
        return self._groups["dp"]

    def get_data_parallel_rank(self) -> int:
        return self.rank_in("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.size("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks("dp")

    def get_sequence_parallel_group(self):
        return self._groups["sp"]

    def get_sequence_parallel_rank(self) -> int:
        return self.rank_in("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.size("sp")

    # ZeRO partitions and reduces over this group (engine.py: seq_data_parallel_group).
    def get_sequence_data_parallel_group(self):
        return self._groups[self.plan.zero_shard]

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank_in(self.plan.zero_shard)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.size(self.plan.zero_shard)


def initialize(plan: ParallelPlan, *, verbose: bool = True) -> ParallelState:
    """Build every group of the plan (collective: all ranks call it, same plan).
    Groups are registered with comm.py under their kind, so the communication
    counter reports bytes per tp/sp/dp/sp_dp group."""
    if not dist.is_initialized():
        raise ConfigError("parallel: torch.distributed is not initialized; call init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    plan.dp(world)
    groups, mine = {}, {}
    for kind, all_ranks in plan.group_ranks(world).items():
        for ranks in all_ranks:  # every rank creates every group, in the same order
            # NOTE: a fresh group even when it spans the world, so each kind is its own
            # object and the counter never merges two kinds' traffic.
            pg = dist.new_group(ranks)
            if rank in ranks:
                groups[kind], mine[kind] = pg, ranks
    for kind, pg in groups.items():
        comm.register_group(pg, kind)
    if verbose and rank == 0 and plan.tp * plan.sp > 1:  # data parallel alone: the table says nothing more
        print(plan.placement_table(world), flush=True)
    return ParallelState(plan, groups, mine)


def destroy() -> None:
    """Forget the group names (tests build several plans in one process)."""
    comm.clear_groups()


# ---- the trainer's plan ----


def plan_of(cfg: TrainConfig) -> ParallelPlan:
    p = cfg.parallel
    return ParallelPlan(tp=p.tp, sp=p.sp, zero_shard="sp" if p.grad_compression == "topk" else "sp_dp")


def check_layout(cfg: TrainConfig, world: int, model_cfg: GrootConfig) -> int:
    """Preflight (no process group): the layout fits the world, the model and the memory policies.
    Returns the DP size."""
    p = plan_of(cfg)
    dp = p.dp(world)  # ConfigError when world % (tp*sp) != 0
    check_model_split(model_cfg, tp=p.tp, sp=p.sp)
    mem = getattr(cfg, "memory", None)
    if p.sp > 1 and mem is not None and getattr(mem, "cuda_graphs", False):
        # NOTE: a captured block would replay the Ulysses all-to-alls of the batch it was captured on.
        raise ConfigError(f"parallel.sp={p.sp}: --cuda-graphs is not combined with sequence parallelism; "
                          "drop it or use --sp 1")
    if p.tp * p.sp > 1 and mem is not None and (mem.fp8 or mem.fuse == "on"):
        # NOTE: the FP8 swap converts nn.Linear only, so the TP shards would stay in high precision,
        # and fusion is untested around the TP collectives and the Ulysses all-to-alls.
        raise ConfigError(f"parallel.tp={p.tp} sp={p.sp}: --fp8 and --fuse on are not combined with tensor or "
                          "sequence parallelism yet; drop them or use --tp 1 --sp 1")
    return dp


def check_model_split(m: GrootConfig, *, tp: int, sp: int) -> None:
    """What TP splits (heads and MLP widths of the vision tower, the LLM and the DiT) divides by tp;
    the LLM's query and KV heads, which Ulysses also splits, by tp x sp."""
    v, t, d = m.vision, m.text, m.dit
    need = [("vision heads", v.num_attention_heads, tp), ("vision MLP width", v.intermediate_size, tp),
            ("LLM query heads", t.num_attention_heads, tp * sp), ("LLM KV heads", t.num_key_value_heads, tp * sp),
            ("LLM MLP width", t.intermediate_size, tp), ("DiT heads", d.num_attention_heads, tp),
            ("DiT MLP width", 4 * d.inner_dim, tp)]
    for what, n, by in need:
        if n % by:
            raise ConfigError(f"parallel: the model's {what} ({n}) is not divisible by "
                              f"{'tp x sp' if by == tp * sp and sp > 1 else 'tp'} = {by}; pick a layout that divides "
                              "it (N1.6: tp x sp must divide its 8 KV heads)")


def is_hybrid(state: ParallelState) -> bool:
    """TP, SP or hybrid sharding: DeepSpeed gets the plan as its mpu. A plain run (tp = sp = 1,
    ZeRO over every rank) builds its groups too (the counter names them) but is handed to
    DeepSpeed exactly as without a plan."""
    return state.plan.tp * state.plan.sp > 1 or state.plan.zero_shard != "sp_dp"


def replica_ranks(state: ParallelState, world: int) -> list[int]:
    """One global rank per DP replica (tp = sp = 0), in DP order: the rows of a step's gathered
    losses and sample ids that are not copies (TP ranks of one replica hold the same ones)."""
    p = state.plan
    return [p.rank_of(0, 0, d) for d in range(p.dp(world))]


def layout(state: ParallelState) -> dict:
    """Recorded in the checkpoint sidecar and the metrics lines."""
    return {"tp": state.plan.tp, "sp": state.plan.sp}
