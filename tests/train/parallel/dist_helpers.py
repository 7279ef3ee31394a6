"""Run a function on W real gloo processes (torch.multiprocessing spawn), with a
deadline: a hang becomes a test failure, a rank's exception fails the test with
its traceback. Plus the tiny transformer the parallel tests share: a block with
the trunk's interface (qkv [q|k|v] by heads, proj, fc1, fc2, attn(q, k, v, mask,
dropout_p) on (B, H, N, Dh)), its local head count derived from tensor shapes."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def _entry(rank: int, fn, world: int, store: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, os.path.join(tmp, "store"), args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{fn.__name__} on {world} ranks did not finish within {timeout:.0f} s")


def sdpa(q, k, v, mask, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2):
        super().__init__()
        self.head_dim, self.attn = dim // heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v, mask, 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyModel(nn.Module):
    """Tokens (B, N, din) = [video | text | action] -> 2 blocks -> head on the action tokens."""

    def __init__(self, din=8, dim=16, heads=4, depth=2, dout=4, n_action=3):
        super().__init__()
        self.n_action = n_action
        self.embed = nn.Linear(din, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, dout)

    def forward(self, x, mask, target):
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h, mask)
        out = self.head(self.ln_f(h)[:, -self.n_action:])
        return F.mse_loss(out, target)


def make_batch(seed: int, b=4, n_video=7, n_text=2, n_action=3, din=8, dout=4):
    """Tokens, the multimodal mask (per-sample invalid video tail, causal actions), targets."""
    g = torch.Generator().manual_seed(seed)
    n = n_video + n_text + n_action
    x = torch.randn(b, n, din, generator=g)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, n_video - 3:n_video] = False  # a sample with fewer frames
    is_action = torch.arange(n) >= n - n_action
    qi, kj = torch.arange(n)[:, None], torch.arange(n)[None]
    allowed = torch.where(is_action[:, None], ~is_action[None] | (kj <= qi), ~is_action[None])
    mask = allowed[None] & valid[:, None, :]
    mask = torch.where(~valid[:, :, None], torch.eye(n, dtype=torch.bool)[None], mask)[:, None]
    return x, mask, torch.randn(b, n_action, dout, generator=g), n_video
