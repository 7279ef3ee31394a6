"""Sequence parallelism over the video tokens only (DeepSpeed-Ulysses style).

A sample's sequence is [video | replicated], video = the patch tokens of every
camera and frame (long, balanced), replicated = state, language and action
tokens (short). `SequenceParallel.split` gives each of the S ranks of the SP
group ceil(Nv/S) consecutive video tokens (the video is padded to a multiple
of S; pad keys are masked, a pad query attends to itself only) and keeps the
replicated tokens whole on every rank. Norms and MLPs are token-local. The
attention (`SequenceParallel.attention(inner)`, a drop-in for a block's
`attn(q, k, v, mask, dropout_p)` on (B, H, N, Dh)) does:

    video q,k,v  all-to-all: scatter heads, gather sequence -> H/S heads x all video
    replicated   keep my H/S heads (no comm forward; all-gather of grads backward)
    attention    over [all video | replicated] with the full (padded) boolean mask
    output       video: all-to-all back (scatter sequence, gather heads);
                 replicated: all-gather heads (backward keeps my heads)

Why Ulysses and not an all-gather of K/V (per rank, per layer, forward; the
backward moves the same again), hidden size d, Nv video and Nr replicated tokens:
    Ulysses    (4 Nv/S + Nr) * d * (S-1)/S     q,k,v and output all-to-all + replicated heads
    K/V gather  2 Nv * d * (S-1)/S             every rank gathers all video K and V
(backward: the inverse all-to-alls vs a reduce-scatter of dK, dV). For this
token mix Nr << Nv (e.g. 2 cameras x 4 frames x 256 patches = 2048 video vs ~50
state+text+action tokens), so Ulysses moves ~(2/S + Nr/(2Nv)) of K/V gather's
bytes: 0.51x at S=4, 0.26x at S=8; it ties at S=2. K/V gather also keeps the
whole video's K/V on every rank (memory O(Nv), not O(Nv/S)) and computes the
replicated queries' attention S times. Ulysses needs heads % (T*S) == 0 and its
all-to-all is latency-bound across nodes: the plan keeps SP inside a node.

Replicated tokens and gradients. Every SP rank computes the replicated tokens
in full, so their contribution to a parameter's gradient would be counted S
times when the gradients are summed over the SP group (ZeRO does that sum). The
hooks of `apply_sequence_parallel` weight it 1/S: around each token-local module
with parameters, the output's gradient rows of replicated tokens are scaled by
1/S (the parameter gradient sees the weight) and the input's by S (the
activation gradient flowing on stays exact; exact in floating point for S a
power of two).
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
    n_video: int  # real video tokens of the sample
    n_local: int  # video tokens per rank (padded)
    n_rep: int  # replicated tokens (state, language, action), on every rank
    size: int  # SP group size

    @property
    def n_video_padded(self) -> int:
        return self.n_local * self.size


def pad_mask(mask: torch.Tensor, layout: SPLayout) -> torch.Tensor:
    """(B, 1, N, N) mask over [video | replicated] -> the same over [video | pads | replicated]:
    pad keys invisible to every query, a pad query sees itself only (no NaN rows)."""
    nv, npad = layout.n_video, layout.n_video_padded - layout.n_video
    if npad == 0:
        return mask
    b, n = mask.shape[0], mask.shape[-1] + npad
    keep = torch.cat([torch.arange(nv), torch.arange(nv + npad, n)]).to(mask.device)
    out = torch.zeros(b, 1, n, n, dtype=torch.bool, device=mask.device)
    out[:, :, keep[:, None], keep[None, :]] = mask
    pads = torch.arange(nv, nv + npad, device=mask.device)
    out[:, :, pads, pads] = True
    return out


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


class SequenceParallel:
    """The SP group, the layout of the current batch, and the Ulysses attention."""

    def __init__(self, state):
        self.group, self.size, self.rank = state.group("sp"), state.size("sp"), state.rank_in("sp")
        self.layout: SPLayout | None = None

    def split(self, seq: torch.Tensor, n_video: int, mask: torch.Tensor | None = None):
        """(B, N, ...) full sequence, video first -> my (B, n_local + Nr, ...) tokens and the padded
        mask; records the layout the attention and the gradient hooks of this batch use."""
        n_local = math.ceil(n_video / self.size)
        self.layout = lay = SPLayout(n_video, n_local, seq.shape[1] - n_video, self.size)
        video = seq[:, :n_video]
        if lay.n_video_padded > n_video:
            pad = video.new_zeros(video.shape[0], lay.n_video_padded - n_video, *video.shape[2:])
            video = torch.cat([video, pad], dim=1)
        mine = video[:, self.rank * n_local:(self.rank + 1) * n_local]
        local = torch.cat([mine, seq[:, n_video:]], dim=1)
        return local, (None if mask is None else pad_mask(mask, lay))

    def gather_video(self, local: torch.Tensor) -> torch.Tensor:
        """My video tokens -> all real video tokens (backward keeps my slice)."""
        lay = self.layout
        return gather_from(local[:, :lay.n_local], 1, self.group)[:, :lay.n_video]

    def attention(self, inner):
        def sp_attention(q, k, v, mask, dropout_p=0.0):
            n, s = self.layout.n_local, self.size
            if q.shape[1] % s:
                raise ConfigError(f"parallel.sp={s}: {q.shape[1]} local attention heads do not split {s} ways; "
                                  "choose heads as a multiple of tp*sp")
            qkv = torch.stack([q, k, v])  # (3, B, H, n_local + Nr, Dh): one all-to-all, not three
            video = all_to_all(qkv[:, :, :, :n], 2, 3, self.group)  # (3, B, H/S, S*n_local, Dh)
            rep = scatter_to(qkv[:, :, :, n:], 2, self.group)  # (3, B, H/S, Nr, Dh)
            full = torch.cat([video, rep], dim=3)
            y = inner(full[0], full[1], full[2], mask, dropout_p)  # (B, H/S, Nv_pad + Nr, Dh)
            y_video = all_to_all(y[:, :, :s * n], 2, 1, self.group)  # (B, H, n_local, Dh)
            y_rep = gather_from(y[:, :, s * n:], 1, self.group)  # (B, H, Nr, Dh)
            return torch.cat([y_video, y_rep], dim=2)

        return sp_attention

    def _rows(self, x: torch.Tensor) -> int:
        lay = self.layout
        # A module fed a shorter sequence than the local layout (a head over the action
        # tokens) reads replicated tokens only.
        return lay.n_local if x.shape[1] == lay.n_local + lay.n_rep else 0

    def _pre(self, module, args):
        x = args[0]
        return (_RepGradScale.apply(x, self._rows(x), float(self.size)), *args[1:])

    def _post(self, module, args, out):
        return _RepGradScale.apply(out, self._rows(args[0]), 1.0 / self.size)


def token_local_param_modules(model: nn.Module) -> list[nn.Module]:
    """The token-wise modules with parameters: Linear, LayerNorm, Embedding, TP linears."""
    kinds = (nn.Linear, nn.LayerNorm, nn.Embedding, ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules() if isinstance(m, kinds)]


def apply_sequence_parallel(model: nn.Module, sp: SequenceParallel, modules=None) -> list:
    """Route every block's `attn` through Ulysses and weight replicated tokens' parameter
    gradients 1/S. `modules`: the token-local modules with parameters that see the
    sequence as (B, N, ...) (default: token_local_param_modules). Returns hook handles."""
    if sp.size == 1:
        return []
    for blk in model.modules():
        if callable(getattr(blk, "attn", None)) and hasattr(blk, "qkv"):
            blk.attn = sp.attention(blk.attn)
    handles = []
    for m in token_local_param_modules(model) if modules is None else modules:
        handles.append(m.register_forward_pre_hook(sp._pre))
        handles.append(m.register_forward_hook(sp._post))
    return handles
