"""The collectives of TP and SP as small named autograd functions whose forward
and backward mirror each other (Megatron's mappings). Plain torch.distributed
calls through comm.py, so they run on gloo and NCCL alike and are counted per
group. NOTE: torch.distributed.nn.functional.all_gather's backward fails on a
gloo subgroup in torch 2.13, hence our own.

    copy_to       fwd identity           bwd all-reduce      (enter a TP region)
    reduce_from   fwd all-reduce         bwd identity        (leave a row-parallel linear)
    scatter_to    fwd keep my chunk      bwd all-gather      (replicated -> split, no comm fwd)
    gather_from   fwd all-gather         bwd keep my chunk   (split -> replicated)
    gather_sum    fwd all-gather         bwd reduce-scatter  (split -> used by whichever rank owns a row)
    all_to_all    fwd scatter dim a,     bwd the inverse     (Ulysses: heads <-> sequence)
                      gather dim b
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.train.parallel import comm


def _world(group) -> int:
    return dist.get_world_size(group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = _world(group)
    if w == 1:
        return x
    x = x.contiguous()
    out = torch.empty((w * x.numel(),), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.view(-1), group)
    return torch.cat(out.view(w, *x.shape).unbind(0), dim=dim)


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = _world(group)
    if w == 1:
        return x
    if x.shape[dim] % w:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split {w} ways")
    return x.chunk(w, dim=dim)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous().clone()
    comm.all_reduce(x, group)
    return x


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _chunk(g, ctx.dim, ctx.group), None, None


class _GatherSum(torch.autograd.Function):
    """All-gather forward; backward sums the gradient over the group and keeps my chunk (a
    reduce-scatter): for a gathered tensor whose consumers are spread over the ranks, each row's
    gradient living on whichever rank used it."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _chunk(_all_reduce(g, ctx.group), ctx.dim, ctx.group), None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    w = _world(group)
    if w == 1:
        return x
    if x.shape[scatter_dim] % w:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split {w} ways")
    send = torch.stack(x.chunk(w, dim=scatter_dim)).contiguous()  # chunk j goes to rank j
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # chunk j came from rank j


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g, gather_dim, scatter_dim, ctx.group), None, None, None


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFrom.apply(x, group)


def scatter_to(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _ScatterTo.apply(x, dim, group)


def gather_from(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherFrom.apply(x, dim, group)


def all_reduce_grad(g: torch.Tensor, group) -> torch.Tensor:
    """A parameter's gradient summed over `group` (a hook on a replicated parameter whose ranks each
    see part of its uses)."""
    return _all_reduce(g, group)


def gather_sum(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherSum.apply(x, dim, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
