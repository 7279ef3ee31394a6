"""Tensor parallelism as a module swap applied from outside the model.

`apply_tensor_parallel(model, state)` replaces, in every block that exposes
`qkv`, `proj`, `fc1`, `fc2` (nn.Linear), the linears by their TP shards:

    qkv  (dim -> 3*dim, [q|k|v], heads*head_dim each)  column-split BY HEADS:
         rank t keeps heads [t*H/T, (t+1)*H/T) of each of q, k, v, so its
         local output is [q_t | k_t | v_t] and the block, which derives its
         local head count from the tensor shape, needs no change;
    proj row-split (input = the local heads' outputs), all-reduce after;
    fc1  column-split (hidden/T), fc2 row-split, all-reduce after.

Two all-reduces per block in forward (after proj, after fc2) and two in
backward (copy_to before qkv and fc1), all inside the TP group. Embeddings,
norms and heads stay replicated: they are small next to the trunk and
splitting them would add collectives outside the blocks (documented choice).
Shards are cut from the full, identically seeded weights, so a TP run starts
from the exact single-process initialisation. Every sharded tensor carries
`tensor_model_parallel=True` (DeepSpeed's gradient norm counts it per shard,
not once) plus `partition_dim` and `tp_index` (which rows/columns of the full
tensor it holds) for gathering and checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel.mappings import copy_to, reduce_from


def _mark(p: nn.Parameter, dim: int, index: torch.Tensor, full: int) -> None:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    p.tp_index, p.tp_full_size = index, full


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[idx].T + b[idx]; input replicated, output split over the TP group."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[index].clone())
        _mark(self.weight, 0, index, linear.out_features)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[index].clone())
            _mark(self.bias, 0, index, linear.out_features)

    def forward(self, x):
        return F.linear(copy_to(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, idx].T) + b; input split, output replicated."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[:, index].clone())
        _mark(self.weight, 1, index, linear.in_features)
        # NOTE: the bias is added after the reduction, once; it stays replicated.
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return reduce_from(F.linear(x, self.weight), self.group) + (0 if self.bias is None else self.bias)


def chunk_index(n: int, rank: int, world: int) -> torch.Tensor:
    step = n // world
    return torch.arange(rank * step, (rank + 1) * step)


def qkv_index(dim3: int, rank: int, world: int) -> torch.Tensor:
    third = dim3 // 3  # heads*head_dim of each of q, k, v
    return torch.cat([part * third + chunk_index(third, rank, world) for part in range(3)])


def is_tp_block(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("qkv", "proj", "fc1", "fc2"))


def _check(block: nn.Module, world: int) -> None:
    dim3, hidden = block.qkv.out_features, block.fc1.out_features
    head_dim = getattr(block, "head_dim", None)
    heads = dim3 // 3 // head_dim if head_dim else None
    if dim3 % 3 or (heads is not None and heads % world) or (dim3 // 3) % world:
        raise ConfigError(f"parallel.tp={world}: attention heads ({heads}) of {type(block).__name__} "
                          "do not split evenly; choose heads as a multiple of tp")
    if hidden % world:
        raise ConfigError(f"parallel.tp={world}: MLP hidden size {hidden} is not divisible by tp")


def apply_tensor_parallel(model: nn.Module, state) -> int:
    """Swap the linears of every TP-able block in place; returns how many blocks were swapped."""
    group = state.group("tp")
    world, rank = state.size("tp"), state.rank_in("tp")
    blocks = [m for m in model.modules() if is_tp_block(m)]
    if world == 1:
        return 0
    for blk in blocks:
        _check(blk, world)
        qkv, proj, fc1, fc2 = blk.qkv, blk.proj, blk.fc1, blk.fc2
        blk.qkv = ColumnParallelLinear(qkv, qkv_index(qkv.out_features, rank, world), group)
        blk.proj = RowParallelLinear(proj, chunk_index(proj.in_features, rank, world), group)
        blk.fc1 = ColumnParallelLinear(fc1, chunk_index(fc1.out_features, rank, world), group)
        blk.fc2 = RowParallelLinear(fc2, chunk_index(fc2.in_features, rank, world), group)
    return len(blocks)
