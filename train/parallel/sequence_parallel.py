"""Ulysses sequence parallelism over the LLM's image tokens (DeepSpeed-Ulysses style).

N1.6's LLM reads [chat text | image tokens | text] per sample, the image tokens (81 per image at
N1.6's size, one image per camera and frame) far outnumbering the text. `SequenceParallel.split`
reorders each row to [image tokens | the rest] (the gather index is per row: left padding moves
the image tokens), gives each of the S ranks of the SP group ceil(Nv/S) consecutive image tokens
(padded to a multiple of S) and keeps the rest (Nr tokens) whole on every rank; positions travel
with their tokens, so the rotary embedding sees the original ones. Norms and MLPs are token-local.
The attention (`SequenceParallel.attention(inner)`, a drop-in for a site's bound kernel on
(B, H, N, Dh)) does:

    image q,k,v  all-to-all: scatter heads, gather sequence -> H/S heads x all image tokens
    the rest     keep my H/S heads (no comm forward; all-gather of grads backward)
    reorder      back to the original token order (pads dropped): the kernel and the causal
                 mask are the model's own, flash's causal varlen included
    output       reordered to [image | rest], image: all-to-all back (scatter sequence, gather
                 heads); the rest: all-gather heads (backward keeps my heads)

Grouped KV heads (Qwen3: 16 query, 8 KV heads) split the same way, so tp x sp must divide the KV
heads. Ulysses against an all-gather of K/V: with N1.6's grouped KV heads (K and V each half of Q's
width) Ulysses moves about 3/S + Nr/Nv times the bytes of the K/V all-gather (parallel/README.md has
the derivation): more below S = 8 (1.22x at S = 4 for 2 images, 0.84x at S = 8). What it buys is
O(Nv/S) activation memory instead of O(Nv) in every LLM layer. Its all-to-all is latency-bound
across nodes: the plan keeps SP inside a node.

Replicated tokens and gradients. Every SP rank computes the rest in full, so its contribution to a
parameter's gradient would be counted S times when ZeRO sums over the SP group. The hooks of
`apply_sequence_parallel` weight it 1/S: around each token-local module with parameters, the
output's gradient rows of replicated tokens are scaled by 1/S (the parameter gradient sees the
weight) and the input's by S (the activation gradient flowing on stays exact; exact in floating
point for S a power of two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel.mappings import all_to_all, gather_from, scatter_to
from loongforge.train.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True, slots=True)
class SPLayout:
    n_video: int  # real image tokens per row
    n_local: int  # image tokens per rank (padded)
    n_rep: int  # the rest, on every rank
    size: int
    to_orig: torch.Tensor  # (B, N) original position -> index in [all image (padded) | rest]
    to_perm: torch.Tensor  # (B, Nvp + Nr) index in [all image (padded) | rest] -> original position

    @property
    def n_video_padded(self) -> int:
        return self.n_local * self.size


class _RepGradScale(torch.autograd.Function):
    """Identity forward; backward scales the gradient rows [start:] of dim 1 by `factor`."""

    @staticmethod
    def forward(ctx, x, start, factor):
        ctx.start, ctx.factor = start, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[:, ctx.start:] *= ctx.factor
        return g, None, None


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) -> x[b, idx[b]] (B, M, ...)."""
    shape = (*idx.shape, *x.shape[2:])
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(shape))


def _cols(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, h, N, d) -> x[b, :, idx[b]] (B, h, M, d)."""
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))


class SequenceParallel:
    """The SP group, the layout of the current batch, and the Ulysses attention."""

    def __init__(self, state):
        self.group, self.size, self.rank = state.group("sp"), state.size("sp"), state.rank_in("sp")
        self.layout: SPLayout | None = None

    def split(self, seq: torch.Tensor, positions: torch.Tensor, video: torch.Tensor):
        """seq (B, N, d), positions (B, N), video (B, N) bool (the image tokens, the same count in every
        row) -> my (B, n_local + Nr, d) tokens and their positions; records the batch's layout."""
        b, n = video.shape
        counts = video.sum(1)
        nv = int(counts[0])  # NOTE: host sync, once per batch (not per layer)
        if not bool((counts == nv).all()):
            raise ConfigError("parallel.sp: the rows of a batch hold different numbers of image tokens")
        # Stable sort on "not image" puts each row's image tokens first, in order, then the rest.
        perm = torch.argsort((~video).to(torch.uint8), dim=1, stable=True)
        n_local = math.ceil(nv / self.size)
        nvp = n_local * self.size
        ar = torch.arange(n, device=seq.device)
        padded = torch.cat([perm[:, :nv], perm.new_zeros(b, nvp - nv), perm[:, nv:]], dim=1)
        slot = torch.where(ar < nv, ar, ar + nvp - nv)  # where each of perm's entries lands in `padded`
        to_orig = torch.empty_like(perm).scatter_(1, perm, slot[None].expand(b, n))
        self.layout = SPLayout(nv, n_local, n - nv, self.size, to_orig, padded)
        seq = _RepGradScale.apply(_rows(seq, perm), nv, 1.0 / self.size)  # the rest: 1/S into the embeddings
        pos = _rows(positions, perm)
        img, rest = seq[:, :nv], seq[:, nv:]
        if nvp > nv:
            img = torch.cat([img, img.new_zeros(b, nvp - nv, img.shape[2])], dim=1)
            pos = torch.cat([pos[:, :nv], pos.new_zeros(b, nvp - nv), pos[:, nv:]], dim=1)
        lo, hi = self.rank * n_local, (self.rank + 1) * n_local
        return torch.cat([img[:, lo:hi], rest], dim=1), torch.cat([pos[:, lo:hi], pos[:, nvp:]], dim=1)

    def merge(self, local: torch.Tensor) -> torch.Tensor:
        """My tokens -> the full (B, N, d) sequence in the original order (backward keeps my image slice)."""
        lay = self.layout
        img = gather_from(local[:, :lay.n_local].contiguous(), 1, self.group)
        return _rows(torch.cat([img, local[:, lay.n_local:]], dim=1), lay.to_orig)

    def attention(self, inner):
        def sp_attention(q, k, v, mask, dropout_p=0.0):
            lay, s = self.layout, self.size
            n = lay.n_local
            if q.shape[1] % s or k.shape[1] % s:
                raise ConfigError(f"parallel.sp={s}: {q.shape[1]} query / {k.shape[1]} KV heads per rank do not "
                                  f"split {s} ways; choose tp x sp dividing the KV heads")

            def to_full(x):  # (B, h, n_local + Nr, d) -> (B, h/S, N, d) in the original order
                img = all_to_all(x[:, :, :n], 1, 2, self.group)
                return _cols(torch.cat([img, scatter_to(x[:, :, n:], 1, self.group)], dim=2), lay.to_orig)

            y = _cols(inner(to_full(q), to_full(k), to_full(v), mask, dropout_p), lay.to_perm)
            img = all_to_all(y[:, :, :s * n], 2, 1, self.group)  # (B, H, n_local, Dh)
            return torch.cat([img, gather_from(y[:, :, s * n:], 1, self.group)], dim=2)

        return sp_attention

    def _n_img(self, x: torch.Tensor) -> int:
        lay = self.layout
        return lay.n_local if x.shape[1] == lay.n_local + lay.n_rep else 0

    def _pre(self, module, args):
        x = args[0]
        return (_RepGradScale.apply(x, self._n_img(x), float(self.size)), *args[1:])

    def _post(self, module, args, out):
        return _RepGradScale.apply(out, self._n_img(args[0]), 1.0 / self.size)


def token_local_param_modules(model: nn.Module) -> list[nn.Module]:
    """The token-wise modules with parameters: linears, norms (LayerNorm, RMSNorm), embeddings."""
    kinds = (nn.Linear, nn.LayerNorm, nn.Embedding, ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules()
            if isinstance(m, kinds) or (type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight"))]


def apply_sequence_parallel(sites: list[nn.Module], modules: list[nn.Module], sp: SequenceParallel,
                            kernel_attr: str) -> list:
    """Route each attention site's bound kernel through Ulysses and weight the replicated tokens'
    parameter gradients 1/S in `modules`. Returns hook handles."""
    for site in sites:
        site.__dict__[kernel_attr] = sp.attention(site.__dict__[kernel_attr])
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(sp._pre))
        handles.append(m.register_forward_hook(sp._post))
    return handles
