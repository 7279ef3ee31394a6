"""Sequence parallelism on N1.6's video tokens, installed from outside the model.

The model leaves two places where its work may be re-cut (train/model/backbone.py): `images`
around the vision tower and `tokens` around the LLM layers. Under SP (group of S ranks):

    images   each rank runs the vision tower and mlp1 on ceil(N/S) of the batch's N images (the
             image batch padded to a multiple of S with black images); the embeddings are all-gathered
             after mlp1. Images attend within themselves only, so this needs no communication inside
             the tower: the cheapest sequence split there is.
    tokens   the LLM's image tokens are sharded, the text tokens replicated, and every attention runs
             through Ulysses (sequence_parallel.py).

Three regions, and how their gradients come out right after ZeRO sums over SP, with c = ZeRO's
own divisor over SP (1 for ZeRO-1/2, which sum; S for ZeRO-3, whose reduce-scatter averages over the
shard group, zero.zero_loss_scale):
  * the loss's gradient is seeded with c/S: everything after the LLM (vlln, the action head) is
    computed identically on the S ranks, so their gradients sum to c x the true one;
  * `tokens.merge` multiplies the gradient by S on the way back: the LLM sees c x the true
    activation gradient, image rows for my slice only; inside it the hooks of
    sequence_parallel.py weight the replicated rows' parameter gradients 1/S; `tokens.split`
    scales the replicated rows' gradient 1/S on the way back into the embeddings, and each image
    token's gradient reaches only the rank that owns it in the LLM's split;
  * `images.merge` is an all-gather whose backward sums over the group and keeps my images (a
    reduce-scatter): an image's tokens may be owned by another rank in the LLM's split, and the
    sum collects them. Each image is embedded on one rank: its parameter gradients count once.
Tested against one process in tests/train/parallel/test_video_sp.py (layouts, ZeRO-3).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.model.attention import KERNEL_ATTR, attention_sites
from loongforge.train.parallel.mappings import gather_sum
from loongforge.train.parallel.sequence_parallel import (SequenceParallel, apply_sequence_parallel,
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


class ImageShards:
    """`model.images` under SP: my share of the image batch through the vision tower."""

    def __init__(self, sp: SequenceParallel):
        self.sp, self.n = sp, 0

    def split(self, pixels: torch.Tensor) -> torch.Tensor:
        s, self.n = self.sp.size, pixels.shape[0]
        per = math.ceil(self.n / s)
        if per * s > self.n:
            pixels = torch.cat([pixels, pixels.new_zeros(per * s - self.n, *pixels.shape[1:])])
        return pixels[self.sp.rank * per:(self.sp.rank + 1) * per]

    def merge(self, embeds: torch.Tensor) -> torch.Tensor:
        return gather_sum(embeds.contiguous(), 0, self.sp.group)[:self.n]


class TokenShards:
    """`model.tokens` under SP: the LLM's image tokens sharded, the rest replicated."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def split(self, seq, positions, mask, image_mask):
        local, pos = self.sp.split(seq, positions, image_mask)
        return local, pos, mask  # the mask stays the original order's: the attention reorders to it

    def merge(self, seq: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(self.sp.merge(seq), float(self.sp.size))


def apply_video_sequence_parallel(model: nn.Module, sp: SequenceParallel, *, zero_divisor: float = 1.0) -> list:
    """Install SP on an N1.6 model (module docstring). Returns the hook handles; S = 1 installs nothing."""
    if sp.size == 1:
        return []
    eagle = getattr(getattr(model, "backbone", None), "model", None)
    if eagle is None or not hasattr(eagle, "tokens") or not hasattr(eagle, "images"):
        raise ConfigError(f"parallel.sp={sp.size}: {type(model).__name__} exposes no backbone.model.images/tokens "
                          "to shard its video tokens; use --sp 1")
    eagle.images, eagle.tokens = ImageShards(sp), TokenShards(sp)
    lm = eagle.language_model.model
    handles = apply_sequence_parallel(attention_sites(lm), token_local_param_modules(lm.layers) + [lm.norm], sp,
                                      KERNEL_ATTR)
    factor = zero_divisor / sp.size

    def seed_loss(module, args, out):
        if isinstance(out, dict) and "loss" in out and out["loss"].requires_grad:
            out["loss"] = _ScaleGrad.apply(out["loss"], factor)
        return out

    handles.append(model.register_forward_hook(seed_loss))
    return handles
