"""Sequence parallel on the VLA model's video tokens, installed from outside the model.

The model (train/model/model.py) hands its trunk sequence to `model.trunk_tokens`: `split(seq,
n_video, mask)` before the trunk blocks and `merge(seq)` after them. `VideoTokens` shards
there: each SP rank keeps ceil(Nv/S) consecutive video tokens (the video span padded to a
multiple of S; with the recipes' vision_tokens a multiple of S no frame bucket ever pads)
and all replicated tokens (state, text). The trunk's attention runs over the full padded
sequence through Ulysses (sequence_parallel.py), with the model's own mask description
extended by a zero-length "sp_pad" segment, so every attention backend (sdpa's dense mask,
flex's block mask, flash's varlen tables) masks the pads without a new code path: a pad key
is invisible, a pad query sees itself only.

Three regions, and how their gradients come out right after ZeRO sums over SP:

    embeddings (before split)   every SP rank computes all tokens; token-local
    trunk blocks                my video slice + replicated tokens; Ulysses attention
    vl_norm + heads + loss      every SP rank computes everything from the merged sequence

With c = ZeRO's own divisor over SP (1 for ZeRO-1/2, which sum over SP; S for ZeRO-3, whose
reduce-scatter averages over the shard group, zero.zero_loss_scale):
  * the loss's gradient is seeded with c/S: the heads' gradients are identical on the S ranks,
    their sum is c x the true gradient (value of the loss unchanged: logs stay exact);
  * `merge` multiplies the gradient by S on the way back: the trunk sees c x the true
    activation gradient, video rows for my slice only (the all-gather's backward keeps it);
  * inside the trunk the hooks of sequence_parallel.py weight replicated rows' parameter
    gradients 1/S (activation gradients stay exact);
  * `split` scales the replicated rows' gradient by 1/S on the way back into the embeddings,
    which are token-local: video rows reach only the rank that owns them, replicated rows
    are weighted 1/S on each of the S ranks. Every parameter sums to c x its true gradient.
Tested against one process in tests/train/parallel/test_video_sp.py (layouts, ZeRO-3).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.model import mask as masks
from loongforge.train.parallel.mappings import gather_from
from loongforge.train.parallel.sequence_parallel import (SequenceParallel, SPLayout, _RepGradScale,
                                                          apply_sequence_parallel, pad_mask,
                                                          token_local_param_modules)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def padded_layout(layout: masks.VLLayout, n_video: int, n_pad: int) -> masks.VLLayout:
    """The vl layout with a zero-valid "sp_pad" segment of n_pad tokens right after the video span."""
    segs, cut, acc = list(layout.segments), 0, 0
    while acc < n_video and cut < len(segs):
        acc, cut = acc + segs[cut].length, cut + 1
    if acc != n_video:
        raise ConfigError(f"parallel.sp: the video span ({n_video} tokens) does not end on a segment boundary "
                          f"of the vl layout {[s.name for s in layout.segments]}")
    segs.insert(cut, masks.Segment("sp_pad", n_pad))
    zeros = layout.lengths.new_zeros(layout.lengths.shape[0], 1)
    lengths = torch.cat([layout.lengths[:, :cut], zeros, layout.lengths[:, cut:]], dim=1)
    return masks.VLLayout(tuple(segs), lengths)


class VideoTokens:
    """`model.trunk_tokens` under SP: shard the video span, keep the rest replicated."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def split(self, seq: torch.Tensor, n_video: int, mask):
        sp = self.sp
        n_local = math.ceil(n_video / sp.size)
        sp.layout = lay = SPLayout(n_video, n_local, seq.shape[1] - n_video, sp.size)
        seq = _RepGradScale.apply(seq, n_video, 1.0 / sp.size)  # replicated rows: 1/S into the embeddings
        video = seq[:, :n_video]
        n_pad = lay.n_video_padded - n_video
        if n_pad:
            video = torch.cat([video, video.new_zeros(video.shape[0], n_pad, *video.shape[2:])], dim=1)
        local = torch.cat([video[:, sp.rank * n_local:(sp.rank + 1) * n_local], seq[:, n_video:]], dim=1)
        if isinstance(mask, masks.VLSelf):
            mask = masks.VLSelf(padded_layout(mask.layout, n_video, n_pad)) if n_pad else mask
        elif isinstance(mask, torch.Tensor):
            mask = pad_mask(mask, lay)
        else:
            raise ConfigError(f"parallel.sp: the trunk's mask {type(mask).__name__} has no padded form")
        return local, mask

    def merge(self, local: torch.Tensor) -> torch.Tensor:
        lay = self.sp.layout
        video = gather_from(local[:, :lay.n_local], 1, self.sp.group)[:, :lay.n_video]
        return _ScaleGrad.apply(torch.cat([video, local[:, lay.n_local:]], dim=1), float(self.sp.size))


def apply_video_sequence_parallel(model: nn.Module, sp: SequenceParallel, *, zero_divisor: float = 1.0) -> list:
    """Install SP on a model with `trunk_tokens` and `blocks` (train/model/model.py's VLAModel): the
    split/merge hook, Ulysses in the trunk blocks' attention, replicated-row weighting on the
    trunk's token-local modules, and the loss gradient seeded with zero_divisor / S (module
    docstring). Returns the hook handles; S = 1 installs nothing."""
    if sp.size == 1:
        return []
    if not hasattr(model, "trunk_tokens") or not hasattr(model, "blocks"):
        raise ConfigError(f"parallel.sp={sp.size}: {type(model).__name__} exposes no trunk_tokens/blocks "
                          "to shard its video tokens; use --sp 1")
    model.trunk_tokens = VideoTokens(sp)
    handles = apply_sequence_parallel(model.blocks, sp, modules=token_local_param_modules(model.blocks))
    factor = zero_divisor / sp.size

    def seed_loss(module, args, out):
        if isinstance(out, dict) and "loss" in out and out["loss"].requires_grad:
            out["loss"] = _ScaleGrad.apply(out["loss"], factor)
        return out

    handles.append(model.register_forward_hook(seed_loss))
    return handles
