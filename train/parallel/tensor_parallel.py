"""Tensor parallelism as a module swap applied from outside the model.

`apply_tensor_parallel(model, state)` replaces, in every module of a class named in `TP_PLAN`, the
named nn.Linear submodules by their TP shards (Megatron's split, and transformers' own tp_plan for
Qwen3: q/k/v and gate/up "colwise", o/down "rowwise"):

    column  the output features split in T contiguous chunks: for q, k, v that is a split BY HEADS
            (heads are contiguous head_dim-wide blocks), so rank t keeps query heads [tH/T, (t+1)H/T)
            and, with grouped KV heads, exactly the KV heads those queries read; the attention
            counts its local heads from the projected width, so it needs no change;
    row     the input features split the same way, all-reduce after, bias added once.

The blocks of N1.6 (names as in the checkpoint):

    SigLIP2 attention   q_proj, k_proj, v_proj | out_proj        SigLIP2 MLP   fc1 | fc2
    Qwen3 attention     q_proj, k_proj, v_proj | o_proj          Qwen3 MLP     gate_proj, up_proj | down_proj
    DiT attention       to_q, to_k, to_v | to_out.0              DiT FF        net.0.proj | net.2

Two all-reduces per attention + MLP pair in forward (after the row-parallel linears) and two in
backward (copy_to before the column-parallel ones), all inside the TP group; Qwen3's per-head q/k
RMSNorm weights stay whole on every rank and their gradients (each rank's covers its heads) are
summed over the group ("sum"). Embeddings, norms,
the mlp1 connector, the per-embodiment encoders and the DiT's time and output projections stay
replicated: they are small next to the blocks, and splitting them would add collectives outside
the blocks (documented choice). Shards are cut from the full, identically seeded weights, so a TP
run starts from the exact single-process initialisation. Every sharded tensor carries
`tensor_model_parallel=True` (DeepSpeed's gradient norm counts it per shard, not once) plus
`partition_dim` and `tp_index` (which rows/columns of the full tensor it holds) for gathering and
checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel.mappings import all_reduce_grad, copy_to, reduce_from


def _mark(p: nn.Parameter, dim: int, index: torch.Tensor, full: int) -> None:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    p.tp_index, p.tp_full_size = index, full


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[idx].T + b[idx]; input replicated, output split over the TP group. With
    `copy_input=False` the caller has entered the TP region already (one copy_to for the q, k and v
    projections of one input: one backward all-reduce of their summed gradient instead of three)."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, group, copy_input: bool = True):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.weight = nn.Parameter(linear.weight.detach()[index].clone())
        _mark(self.weight, 0, index, linear.out_features)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[index].clone())
            _mark(self.bias, 0, index, linear.out_features)

    def forward(self, x):
        return F.linear(copy_to(x, self.group) if self.copy_input else x, self.weight, self.bias)


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


# Which inputs of a planned module enter its TP region (copy_to: identity forward, all-reduce of the
# gradient backward), once for all its column-parallel linears: positions or keyword names.
TP_INPUTS: dict[str, tuple[int | str, ...]] = {
    "Siglip2Attention": ("hidden_states",), "Siglip2MLP": (0,), "Qwen3Attention": ("hidden_states",),
    "Qwen3MLP": (0,), "DiTAttention": (0, 1), "FeedForward": (0,),
}
TP_PLAN: dict[str, tuple[tuple[str, str], ...]] = {
    "Siglip2Attention": (("q_proj", "col"), ("k_proj", "col"), ("v_proj", "col"), ("out_proj", "row")),
    "Siglip2MLP": (("fc1", "col"), ("fc2", "row")),
    "Qwen3Attention": (("q_proj", "col"), ("k_proj", "col"), ("v_proj", "col"), ("o_proj", "row"),
                       ("q_norm", "sum"), ("k_norm", "sum")),
    "Qwen3MLP": (("gate_proj", "col"), ("up_proj", "col"), ("down_proj", "row")),
    "DiTAttention": (("to_q", "col"), ("to_k", "col"), ("to_v", "col"), ("to_out.0", "row")),
    "FeedForward": (("net.0.proj", "col"), ("net.2", "row")),
}


def tp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in TP_PLAN]


def _sum_grad(norm: nn.Module, group) -> None:
    """A replicated parameter applied to this rank's heads only (Qwen3's per-head q/k RMSNorm): each TP
    rank's gradient covers its heads, the true one is their sum (transformers' tp_plan calls it
    replicated_with_grad_allreduce). The module and its parameter stay as they are; the gradient is
    all-reduced over the TP group as autograd produces it."""
    if norm.weight.requires_grad:  # a frozen layer's norm has no gradient to sum
        norm.weight.register_hook(lambda g: all_reduce_grad(g, group))


def _swap(parent: nn.Module, path: str, kind: str, rank: int, world: int, group) -> None:
    if kind == "sum":
        return _sum_grad(getattr(parent, path), group)
    *up, leaf = path.split(".")
    for part in up:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    lin = parent[int(leaf)] if leaf.isdigit() else getattr(parent, leaf)
    if not isinstance(lin, nn.Linear):
        raise ConfigError(f"parallel.tp={world}: {type(parent).__name__}.{leaf} is {type(lin).__name__}, not "
                          "nn.Linear (a module swap replaced it before TP?)")
    n = lin.out_features if kind == "col" else lin.in_features
    if n % world:
        raise ConfigError(f"parallel.tp={world}: {type(parent).__name__}.{leaf} has {n} "
                          f"{'output' if kind == 'col' else 'input'} features, not divisible by tp")
    idx = chunk_index(n, rank, world)
    new = ColumnParallelLinear(lin, idx, group, copy_input=False) if kind == "col" else RowParallelLinear(lin, idx, group)
    for name, p in new.named_parameters():  # a frozen linear stays frozen (a fine-tune's LLM, the unused head)
        p.requires_grad_(getattr(lin, name).requires_grad)
    if leaf.isdigit():
        parent[int(leaf)] = new
    else:
        setattr(parent, leaf, new)


def apply_tensor_parallel(model: nn.Module, state) -> int:
    """Swap the linears of every module in TP_PLAN in place; returns how many modules were split."""
    group = state.group("tp")
    world, rank = state.size("tp"), state.rank_in("tp")
    mods = tp_modules(model)
    if world == 1:
        return 0
    for _, mod in mods:
        for path, kind in TP_PLAN[type(mod).__name__]:
            _swap(mod, path, kind, rank, world, group)
        mod.register_forward_pre_hook(_enter_region(TP_INPUTS[type(mod).__name__], group), with_kwargs=True)
    return len(mods)


def _enter_region(which: tuple[int | str, ...], group):
    """A forward pre-hook: copy_to on the module's inputs `which` (None inputs, e.g. a self-attention's
    absent context, pass as they are)."""
    def hook(module, args, kwargs):
        args = list(args)
        for w in which:
            if isinstance(w, int) and w < len(args) and args[w] is not None:
                args[w] = copy_to(args[w], group)
            elif isinstance(w, str) and kwargs.get(w) is not None:
                kwargs[w] = copy_to(kwargs[w], group)
        return tuple(args), kwargs

    return hook
