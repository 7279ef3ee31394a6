"""N1.6's AlternateVLDiT, with the reference's module names (diffusers' `Attention`/`FeedForward`
layout: `attn1.to_q/to_k/to_v/to_out.0`, `ff.net.0.proj`, `ff.net.2`, `norm1.linear`,
`timestep_encoder.timestep_embedder.linear_1/2`, `proj_out_1/2`).

Blocks alternate: odd blocks are self-attention over [state | action] tokens, even blocks
cross-attend to the backbone features, to its valid non-image tokens in blocks 0, 2n, 4n, ... and
to its valid image tokens in the others (n = attend_text_every_n_blocks). Every block is
conditioned on the flow timestep through an adaptive LayerNorm. The attention kernel is the
model's one interface (attention.py), bound to each block's `attn1`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model.attention import KERNEL_ATTR
from loongforge.train.model.config import DiTConfig
from loongforge.train.model.mask import Keys


def timestep_features(t: torch.Tensor, channels: int = 256) -> torch.Tensor:
    """diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1): (B,) -> (B, 256)."""
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, channels: int = 256):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(channels, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEncoder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.timestep_embedder.linear_1.weight.dtype
        return self.timestep_embedder(timestep_features(t).to(dtype))


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, scaled and shifted by the timestep embedding: scale first, shift second."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.eps = eps

    def forward(self, x, temb):
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale[:, None]) + shift[:, None]


class DiTAttention(nn.Module):
    """diffusers' Attention as N1.6 configures it: biased q/k/v, output projection + dropout."""

    is_attention_site = True  # attention.attention_sites: a kernel is bound to it

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int, dropout: float):
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(kv_dim, inner), nn.Linear(kv_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(dropout)])

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape  # a TP shard holds fewer heads: count them from the width
        return x.view(b, n, w // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x, context=None, mask=None):
        src = x if context is None else context
        y = self.__dict__[KERNEL_ATTR](self._heads(self.to_q(x)), self._heads(self.to_k(src)),
                                       self._heads(self.to_v(src)), mask, 0.0)
        b, h, n, d = y.shape
        y = y.transpose(1, 2).reshape(b, n, h * d)
        return self.to_out[1](self.to_out[0](y))


class GELUProj(nn.Module):
    """diffusers' GELU(approximate="tanh") with its projection: `ff.net.0.proj`."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int, dropout: float, final_dropout: bool, mult: int = 4):
        super().__init__()
        inner = dim * mult
        layers = [GELUProj(dim, inner), nn.Dropout(dropout), nn.Linear(inner, dim)]
        if final_dropout:
            layers.append(nn.Dropout(dropout))
        self.net = nn.ModuleList(layers)

    def forward(self, x):
        for m in self.net:
            x = m(x)
        return x


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, cfg: DiTConfig, kv_dim: int):
        super().__init__()
        self.norm1 = AdaLayerNorm(dim)
        self.attn1 = DiTAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, kv_dim, cfg.dropout)
        self.ff = FeedForward(dim, cfg.dropout, cfg.final_dropout)
        self.final_dropout = nn.Dropout(cfg.dropout) if cfg.final_dropout else None

    def forward(self, x, temb, context=None, mask: Keys | None = None):
        y = self.attn1(self.norm1(x, temb), context, mask)
        if self.final_dropout is not None:
            y = self.final_dropout(y)
        x = x + y
        return x + self.ff(F.layer_norm(x, x.shape[-1:], eps=1e-5))  # norm3: no affine parameters


class AlternateVLDiT(nn.Module):
    def __init__(self, cfg: DiTConfig, cross_dim: int, attend_text_every_n_blocks: int):
        super().__init__()
        dim = cfg.inner_dim
        self.every = attend_text_every_n_blocks
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(dim, cfg, dim if i % 2 == 1 else cross_dim) for i in range(cfg.num_layers)])
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, cfg.output_dim)

    def forward(self, x, context, t, text_keys: Keys, image_keys: Keys):
        """x (B, T, D) state + action tokens, context (B, S, d) backbone features, t (B,) integer
        timestep buckets -> (B, T, output_dim)."""
        temb = self.timestep_encoder(t)
        for i, block in enumerate(self.transformer_blocks):
            if i % 2 == 1:
                x = block(x, temb)
            else:
                x = block(x, temb, context, text_keys if i % (2 * self.every) == 0 else image_keys)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)  # shift first here, as the reference
        x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(x)
