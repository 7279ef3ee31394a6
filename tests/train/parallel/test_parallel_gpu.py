"""The CUDA/NCCL paths of train/parallel on one GPU (`make gpu-check` runs them; skipped without CUDA).

One NCCL process group of world size 1 for the module, plus a 1-rank gloo group for the CPU
reference of the same code. At world 1 the mappings' collectives are identities, but the NCCL
ops themselves (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
broadcast), the tensors' dtype/device handling, the top-k message packing through an NCCL
all-gather and the per-group accounting all run for real. The multi-rank numerics are
checked on gloo by the other tests of this folder.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.compression import CompressionConfig, TopKCompressor
from loongforge.train.parallel.mappings import all_to_all, copy_to, gather_from, reduce_from, scatter_to
from loongforge.train.parallel.sequence_parallel import SequenceParallel
from loongforge.train.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tests.train.parallel.dist_helpers import gather_tp_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = (torch.float32, torch.bfloat16)
KINDS = ("tp", "sp", "dp", "sp_dp")


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this pytest process")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)  # NOTE: before the group, as engine.init_distributed does per LOCAL_RANK
    store = tmp_path_factory.mktemp("nccl") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=dev)
    try:
        gloo = dist.new_group([0], backend="gloo")
        state = plan.initialize(plan.ParallelPlan(), verbose=False)
        yield SimpleNamespace(dev=dev, gloo=gloo, state=state)
    finally:
        plan.destroy()
        dist.destroy_process_group()


def _distinct(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values whose magnitudes are distinct even in bf16 (consecutive bf16 bit patterns from
    2^-7 up, shuffled, random signs), so top-k has no tie and CPU and CUDA must pick the same k."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.arange(0x3C00, 0x3C00 + n, dtype=torch.int16).view(torch.bfloat16).float()
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (mag[torch.randperm(n, generator=g)] * sign).to(dtype)


def _topk_steps(device, group, dtype, n=3000, steps=3):
    """Three steps of top-k encode -> all-gather of [values | int32 indices] -> decode, with error
    feedback, through the compressor's sparse path on `group`."""
    comp = TopKCompressor(CompressionConfig(density=0.1, mode="sparse"), group, verbose=False)
    comp.residuals = [torch.zeros(n, dtype=dtype, device=device)]
    out = []
    k = comp.k_for(n, torch.empty((), dtype=dtype).element_size())
    seeds = iter(range(1000))
    for _step in range(steps):
        while True:  # bf16 sums can tie: take the next seed (the sums are bitwise equal on CPU and CUDA)
            flat = _distinct(n, dtype, seed=next(seeds)).to(device)
            acc = flat + comp.residuals[0]
            mags = acc.abs().float().sort(descending=True).values.cpu()
            if mags[k - 1] > mags[k]:
                break
        dec = comp._sparse(flat, k, 0)
        assert dec.device == flat.device and dec.dtype == dtype
        assert comp.residuals[0].device == flat.device
        out.append((acc.cpu(), dec.cpu(), comp.residuals[0].to("cpu", copy=True), k))  # updated in place
    return out, comp.sent_bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_error_feedback_on_cuda_equals_cpu(nccl, dtype):
    cpu, cpu_sent = _topk_steps(torch.device("cpu"), nccl.gloo, dtype)
    gpu, gpu_sent = _topk_steps(nccl.dev, nccl.state.group("dp"), dtype)
    for (acc_c, dec_c, res_c, k), (acc_g, dec_g, res_g, _) in zip(cpu, gpu):
        assert torch.equal(acc_c, acc_g)  # the residual carried into this step matched too
        assert torch.equal(dec_c, dec_g) and torch.equal(res_c, res_g)
        assert int((dec_g != 0).sum()) == k  # k survivors, the largest of acc
        assert torch.equal(dec_g + res_g, acc_g)  # error feedback loses nothing (exact at world 1)
        kept = dec_g != 0
        assert acc_g.abs()[kept].min() > acc_g.abs()[~kept].max()
    assert cpu_sent == gpu_sent == 0  # (W-1) * message bytes at W=1


def test_bucket_decisions_and_dense_path_on_cuda_equal_cpu(nccl):
    """Mixed fp32/bf16 gradients: the same buckets (a dtype change closes one), the same cost-model
    decisions, residuals on the gradients' device, and the mean over one replica is the gradient."""

    def run(device, group):
        grads = [_distinct(n, dt, seed=i).to(device) for i, (n, dt) in
                 enumerate([(700, torch.float32), (300, torch.float32), (900, torch.bfloat16), (500, torch.float32)])]
        before = [g.clone() for g in grads]
        comp = TopKCompressor(CompressionConfig(bucket_bytes=4096), group, verbose=False)
        comp.reduce_(grads)
        assert all(r.device == device for r in comp.residuals)
        assert all(torch.equal(a, b) for a, b in zip(grads, before))
        return comp.decisions, comp.describe()

    cpu, gpu = run(torch.device("cpu"), nccl.gloo), run(nccl.dev, nccl.state.group("dp"))
    assert cpu == gpu
    assert [(n, e) for n, _k, _p, e in gpu[0]] == [(1000, 4), (900, 2), (500, 4)]  # 2800 + 1200 B fit 4096
    assert {p for _n, _k, p, _e in gpu[0]} == {"dense"}  # one replica: nothing to sparsify


@pytest.mark.parametrize("dtype", DTYPES)
def test_nccl_collectives_are_counted_per_group(nccl, dtype):
    x = torch.randn(4, 6, device=nccl.dev).to(dtype)
    counter = comm.CommCounter()
    with comm.counting(counter):
        for kind in KINDS:
            pg = nccl.state.group(kind)
            assert dist.get_backend(pg) == "nccl"
            y = x.clone()
            comm.all_reduce(y, pg)
            gathered = torch.empty_like(x)
            comm.all_gather_into_tensor(gathered, x, pg)
            scattered = torch.empty_like(x)
            comm.reduce_scatter_tensor(scattered, x, pg)
            a2a = torch.empty_like(x)
            comm.all_to_all_single(a2a, x, pg)
            comm.broadcast(y, nccl.state.ranks(kind)[0], pg)
            for t in (y, gathered, scattered, a2a):
                assert t.device == nccl.dev and t.dtype == dtype and torch.equal(t, x)
    with comm.patch_torch_distributed(counter):
        dist.all_reduce(x.clone(), group=nccl.state.group("dp"))  # as DeepSpeed issues it
    torch.cuda.synchronize()
    nbytes = x.numel() * x.element_size()
    rows = counter.by_group()
    assert set(rows) == set(KINDS)
    for kind in KINDS:
        calls = 6 if kind == "dp" else 5
        assert rows[kind]["calls"] == calls and rows[kind]["payload_bytes"] == calls * nbytes
        assert rows[kind]["wire_bytes"] == 0  # nothing leaves a 1-rank group


@pytest.mark.parametrize("dtype", DTYPES)
def test_mappings_forward_backward_on_cuda(nccl, dtype):
    pg = nccl.state.group("tp")
    fns = [lambda t: copy_to(t, pg), lambda t: reduce_from(t, pg), lambda t: scatter_to(t, 1, pg),
           lambda t: gather_from(t, 1, pg), lambda t: all_to_all(t, 1, 2, pg)]
    for fn in fns:
        x = torch.randn(2, 4, 3, device=nccl.dev, dtype=dtype, requires_grad=True)
        y = fn(x)
        assert y.device == nccl.dev and y.dtype == dtype and torch.equal(y, x)
        g = torch.randn_like(y)
        y.backward(g)
        assert torch.equal(x.grad, g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tp_linears_match_plain_linears_on_cuda(nccl, dtype):
    torch.manual_seed(0)
    pg = nccl.state.group("tp")
    fc1, fc2 = nn.Linear(16, 32).to(nccl.dev, dtype), nn.Linear(32, 16).to(nccl.dev, dtype)
    col = ColumnParallelLinear(fc1, torch.arange(32), pg)
    row = RowParallelLinear(fc2, torch.arange(32), pg)
    x = torch.randn(3, 5, 16, device=nccl.dev, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = fc2(F.gelu(fc1(xa)))
    out = row(F.gelu(col(xb)))
    # NOTE: not bitwise: nn.Linear fuses the bias into the GEMM, the row-parallel linear adds it
    # after the reduction (once, not per shard), which rounds differently in bf16.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert out.dtype == dtype and out.device == nccl.dev
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    for mine, plain in ((col.weight, fc1.weight), (col.bias, fc1.bias), (row.weight, fc2.weight),
                        (row.bias, fc2.bias)):
        assert mine.grad.device == nccl.dev and mine.grad.dtype == dtype
        torch.testing.assert_close(mine.grad, plain.grad, **tol)
        full = gather_tp_tensor(mine, mine.grad, pg)  # dist.all_gather over NCCL, shard index on device
        assert torch.equal(full, mine.grad)


def _attn(q, k, v, mask, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ulysses_attention_matches_full_attention_on_cuda(nccl, dtype):
    torch.manual_seed(0)
    sp = SequenceParallel(nccl.state)
    b, h, nv, nr, dh = 2, 4, 12, 5, 8
    n = nv + nr
    seq = torch.randn(b, n, h * dh, device=nccl.dev, dtype=dtype)
    mask = torch.rand(b, 1, n, n, device=nccl.dev) > 0.3
    mask |= torch.eye(n, dtype=torch.bool, device=nccl.dev)  # no empty row
    local, local_mask = sp.split(seq, nv, mask)
    assert torch.equal(local, seq) and torch.equal(local_mask, mask)
    qkv = torch.randn(3, b, h, n, dh, device=nccl.dev, dtype=dtype)
    qa, qb = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    ref = _attn(*qa, mask)
    out = sp.attention(_attn)(*qb, local_mask)
    assert out.shape == ref.shape and out.dtype == dtype and torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert torch.equal(qa.grad, qb.grad)
    # and against the CPU kernel, to the dtype's tolerance
    cpu = _attn(*qkv.float().cpu(), mask.cpu())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), cpu, atol=tol, rtol=tol)
    assert torch.equal(sp.gather_video(local), seq[:, :nv])


def test_residuals_loaded_on_the_host_follow_the_cuda_gradients(nccl):
    """A resume loads residuals on the host (zero.CompressedDPSync.load): the next step moves them to
    the gradients' device and flushes them into the dense sync (1 replica: grad + residual)."""
    grads = [torch.randn(64, device=nccl.dev), torch.randn(32, device=nccl.dev)]
    comp = TopKCompressor(CompressionConfig(), nccl.state.group("dp"), verbose=False)
    comp.reduce_([g.clone() for g in grads])
    res = torch.randn(96)
    comp.load_state_dict({"version": 1, "residuals": [res]})
    expect = torch.cat(grads).cpu() + res
    comp.reduce_(grads)
    assert comp.residuals[0].device == nccl.dev
    assert torch.equal(torch.cat(grads).cpu(), expect)
    assert torch.count_nonzero(comp.residuals[0]) == 0
