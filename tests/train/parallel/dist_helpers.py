"""Run a function on W real gloo processes (spawned once, pooled across tests), with a
deadline: a hang becomes a test failure, a rank's exception fails the test with
its traceback. Plus the tiny transformer the parallel tests share: a block with
the trunk's interface (qkv [q|k|v] by heads, proj, fc1, fc2, attn(q, k, v, mask,
dropout_p) on (B, H, N, Dh)), its local head count derived from tensor shapes."""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
import traceback
from multiprocessing import connection as mp_connection

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def _entry(rank: int, fn, world: int, store: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _serve(conn) -> None:
    """A pooled rank: run jobs (rank, fn, world, store, args) until the driver closes the pipe."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        try:
            _entry(*job)
        except BaseException:  # noqa: BLE001 - reported to the driver, which fails the test with it
            conn.send(("error", traceback.format_exc()))
            return  # a failed rank's process state is suspect: never reuse it
        # NOTE: DeepSpeed keeps process-global state (its comm backend, accelerator) past
        # destroy_process_group: a process that imported it runs no further job.
        retire = "deepspeed" in sys.modules
        conn.send(("ok", retire))
        if retire:
            return


class _RankPool:
    """Spawned rank processes kept across run_ranks calls. A spawn costs a Python start and a torch
    import (~3 CPU s), more than most of these tests' work: the parallel tests spawned ~25 of them.
    A call uses the first `world` workers; a failure or a timeout kills the pool (a rank may be blocked
    in a collective), and the next call spawns fresh ones."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []

    def ensure(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        while len(self.procs) < world:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,))
            proc.start()
            child.close()  # so the parent's end reads EOF when the worker dies
            self.procs.append(proc)
            self.conns.append(parent)

    def drop(self, ranks) -> None:
        for r in sorted(ranks, reverse=True):
            self.procs[r].join(timeout=30)
            if self.procs[r].is_alive():
                self.procs[r].kill()
                self.procs[r].join()
            self.conns.pop(r).close()
            self.procs.pop(r)

    def close(self) -> None:
        """Idle workers leave on EOF; whatever does not within 10 s is killed."""
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        for c in self.conns:
            if not c.closed:
                c.close()
        self.procs, self.conns = [], []


_POOL = _RankPool()
atexit.register(_POOL.close)


def run_ranks(fn, world: int, *args, timeout: float = 240) -> None:
    """fn(rank, world, *args) on `world` gloo ranks (pooled processes); a rank's exception fails the
    test with its traceback, a hang fails it after `timeout` seconds."""
    _POOL.ensure(world)
    conns = _POOL.conns[:world]
    with tempfile.TemporaryDirectory() as tmp:
        for rank, conn in enumerate(conns):
            conn.send((rank, fn, world, os.path.join(tmp, "store"), args))
        deadline = time.monotonic() + timeout
        pending, retired, errors = set(range(world)), set(), []
        while pending and not errors:
            left = deadline - time.monotonic()
            if left <= 0:
                _POOL.kill()
                pytest.fail(f"{fn.__name__} on {world} ranks did not finish within {timeout:.0f} s")
            for conn in mp_connection.wait([conns[r] for r in pending], timeout=min(left, 5)):
                rank = conns.index(conn)
                pending.discard(rank)
                try:
                    status, info = conn.recv()
                except EOFError:
                    status, info = "error", f"rank {rank} exited with code {_POOL.procs[rank].exitcode}"
                if status == "error":
                    errors.append((rank, info))
                elif info:
                    retired.add(rank)
    if errors:
        _POOL.kill()  # its peers may be blocked in a collective
        said = "\n".join(f"rank {rank}:\n{info}" for rank, info in errors)  # first to fail first
        pytest.fail(f"{fn.__name__} failed on {len(errors)} of {world} ranks:\n{said}", pytrace=False)
    _POOL.drop(retired)


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


def gather_tp_tensor(p: nn.Parameter, t: torch.Tensor, group) -> torch.Tensor:
    """The full tensor (e.g. a gradient) from the TP shards `t` of parameter `p` on every rank, by the
    shard metadata tensor_parallel.py puts on each split parameter (partition_dim, tp_index, tp_full_size)."""
    if not getattr(p, "tensor_model_parallel", False):
        return t
    w = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(w)]
    mine = p.tp_index.to(t.device)  # NCCL gathers device tensors only
    idx = [torch.empty_like(mine) for _ in range(w)]
    dist.all_gather(parts, t.contiguous(), group=group)
    dist.all_gather(idx, mine, group=group)
    shape = list(t.shape)
    shape[p.partition_dim] = p.tp_full_size
    full = torch.zeros(shape, dtype=t.dtype, device=t.device)
    for part, i in zip(parts, idx):
        full.index_copy_(p.partition_dim, i, part)
    return full
