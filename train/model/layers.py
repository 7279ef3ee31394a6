"""Building blocks of the model. No parallelism here.

NOTE: a tensor-parallel plan swaps the nn.Linear submodules (`qkv`, `q`, `kv`, `proj`, `fc1`,
`fc2`) for column/row-parallel ones from outside. That is why each block derives its local
head count from the projected tensor's width (`q.shape[-1] // head_dim`) instead of storing
it. Every attention goes through one `Attention` object (train/model/attention.py), the one place a
kernel is chosen; blocks hand it a mask description from mask.py, never a mask tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model.attention import Attention


def attention_backend(name: str) -> Attention:
    """auto | sdpa | flex | flash; the kernel itself is chosen on the first call (attention.py)."""
    return Attention(name)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, N, h*hd) -> (B, h, N, hd); h is whatever width this rank holds."""
    b, n, w = x.shape
    return x.view(b, n, w // head_dim, head_dim).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    b, h, n, hd = y.shape
    return y.transpose(1, 2).reshape(b, n, h * hd)


class TrunkBlock(nn.Module):
    """Pre-norm transformer block of the vision-language trunk."""

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, attn, dropout: float):
        super().__init__()
        self.head_dim, self.attn, self.dropout = head_dim, attn, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        hidden = int(dim * mlp_ratio)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        y = self.attn(*(split_heads(z, self.head_dim) for z in (q, k, v)), mask,
                      self.dropout if self.training else 0.0)
        x = x + self.proj(merge_heads(y))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _ZeroLinear(nn.Linear):
    """A linear initialised to zero inside its own constructor. NOTE: zeroing after construction
    is a no-op under deepspeed.zero.Init (ZeRO-3), which partitions each module's parameters as
    its __init__ returns: the weights kept the random init and ZeRO-3 started from another model.
    The default init still runs first, so the RNG stream (every later weight) is unchanged."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()


class AdaNorm(nn.Module):
    """LayerNorm whose scale and shift come from a conditioning vector (GR00T's AdaLayerNorm,
    DiT's adaptive norm): how the flow time reaches every head block."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = _ZeroLinear(dim, 2 * dim)  # starts as a plain LayerNorm

    def forward(self, x, cond):
        scale, shift = self.ada(F.silu(cond)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class HeadBlock(nn.Module):
    """One block of a head: a single attention (self, or cross to the vl tokens, as GR00T's DiT
    interleaves them) and an MLP. `conditioned` = adaptive norm on the flow time."""

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, attn, *, cross: bool, conditioned: bool):
        super().__init__()
        self.head_dim, self.attn, self.cross = head_dim, attn, cross
        self.norm1 = AdaNorm(dim) if conditioned else nn.LayerNorm(dim)
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x, *, context, self_mask, cross_mask, cond=None):
        h = self.norm1(x, cond) if cond is not None else self.norm1(x)
        src, mask = (context, cross_mask) if self.cross else (h, self_mask)
        k, v = self.kv(src).chunk(2, dim=-1)
        y = self.attn(split_heads(self.q(h), self.head_dim), split_heads(k, self.head_dim),
                      split_heads(v, self.head_dim), mask, 0.0)
        x = x + self.proj(merge_heads(y))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] scaled to GR00T's 1000 time buckets (kept continuous)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim - emb.shape[-1]))


def flow_time(u: torch.Tensor, schedule: str) -> torch.Tensor:
    """Per-sample uniform u in [0, 1) -> flow time t (x_t = (1 - t) noise + t action).

    beta: GR00T's schedule, s ~ Beta(1.5, 1) and t = (0.999 - s) / 0.999. Beta(a, 1) has CDF
    s**a, so s = u**(1/1.5) is its inverse-CDF sample: the caller's seeded uniform stays the only
    randomness. Density of t grows toward 0, i.e. toward the noisy end.
    """
    if schedule == "uniform":
        return u.float()
    s = u.float().clamp_min(0.0) ** (1.0 / 1.5)
    return (0.999 - s) / 0.999
