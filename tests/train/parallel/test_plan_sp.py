"""The plan's rank placement and groups (pure), its mpu on 4 gloo ranks, and
Ulysses attention over video tokens == full attention, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel import plan
from tests.train.parallel.dist_helpers import run_ranks


def test_placement_tp_innermost_then_sp_then_dp():
    p = plan.ParallelPlan(tp=2, sp=2)
    groups = p.group_ranks(8)
    assert groups["tp"][0] == [0, 1] and groups["sp"][0] == [0, 2] and groups["dp"][0] == [0, 4]
    assert groups["sp_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for kind, gs in groups.items():  # each kind partitions the world
        assert sorted(r for g in gs for r in g) == list(range(8)), kind
    assert [p.coords(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert all(p.rank_of(*p.coords(r)) == r for r in range(8))
    table = p.placement_table(8)
    assert "tp=2 sp=2 dp=2" in table and table.splitlines()[-1].split() == ["7", "1", "1", "1"]


def test_plan_rejects_bad_layouts():
    with pytest.raises(ConfigError, match="parallel.tp"):
        plan.ParallelPlan(tp=0)
    with pytest.raises(ConfigError, match="not divisible by tp\\*sp"):
        plan.ParallelPlan(tp=2, sp=2).dp(6)
    from loongforge.train.recipes import tiny

    with pytest.raises(ConfigError, match="LLM KV heads \\(4\\) is not divisible by tp x sp = 8"):
        plan.check_model_split(tiny().model, tp=2, sp=4)
    with pytest.raises(ConfigError, match="vision heads \\(2\\) is not divisible by tp = 4"):
        plan.check_model_split(tiny().model, tp=4, sp=1)
    plan.check_model_split(tiny().model, tp=2, sp=2)


def _mpu_worker(rank: int, world: int) -> None:
    mpu = plan.initialize(plan.ParallelPlan(tp=2, sp=2), verbose=False)
    tp, sp, dp = mpu.plan.coords(rank)
    assert (mpu.get_tensor_model_parallel_rank(), mpu.get_sequence_parallel_rank(), mpu.get_data_parallel_rank()) \
        == (tp, sp, dp)
    assert mpu.get_model_parallel_world_size() == 2 and mpu.get_sequence_parallel_world_size() == 2
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_sequence_data_parallel_world_size() == 2
    assert mpu.get_tensor_model_parallel_src_rank() == rank - tp
    assert not hasattr(mpu, "initialize_sequence_parallel")  # else ZeRO drops the TP group
    # Each group really connects the ranks it names: sum of global ranks over the group.
    for kind in ("tp", "sp", "dp", "sp_dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mpu.group(kind))
        assert t.item() == sum(mpu.ranks(kind)), kind
    plan.destroy()


def test_mpu_groups_on_4_ranks():
    run_ranks(_mpu_worker, 4)


def _sp_attention_worker(rank: int, world: int) -> None:
    """Ulysses over the image tokens of left-padded rows (image tokens at different places per row):
    output and input gradients equal one process's causal attention over the whole sequence."""
    from loongforge.train.model.attention import sdpa_dense
    from loongforge.train.model.mask import Causal
    from loongforge.train.parallel.sequence_parallel import SequenceParallel

    mpu = plan.initialize(plan.ParallelPlan(tp=1, sp=2), verbose=False)
    sp = SequenceParallel(mpu)
    g = torch.Generator().manual_seed(0)
    b, n, h, d = 2, 9, 4, 8
    video = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)  # 5 each
    valid = torch.tensor([[1] * 9, [0, 0] + [1] * 7], dtype=torch.bool)
    x = torch.randn(b, n, h * d, generator=g, requires_grad=True)
    mask = Causal(valid)
    heads = lambda t: t.view(t.shape[0], t.shape[1], h, d).transpose(1, 2)  # noqa: E731
    ref = sdpa_dense(heads(x), heads(2 * x), heads(3 * x), mask)
    ref.transpose(1, 2).reshape(b, n, -1).pow(2).sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    local, _ = sp.split(x, torch.arange(n)[None].expand(b, n), video)
    y = sp.attention(sdpa_dense)(heads(local), heads(2 * local), heads(3 * local), mask)
    full = sp.merge(y.transpose(1, 2).reshape(b, local.shape[1], -1))
    torch.testing.assert_close(full, ref.transpose(1, 2).reshape(b, n, -1), rtol=1e-5, atol=1e-6)
    # Every rank holds the whole output and its loss: merge's backward keeps my image rows and the whole
    # rest; split's backward weights the replicated rest 1/S: summed over the group, each input row's
    # gradient counts once, as in one process.
    full.pow(2).sum().backward()
    grad = x.grad.clone()
    dist.all_reduce(grad, group=mpu.group("sp"))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    plan.destroy()


def test_ulysses_attention_equals_full_attention_2_ranks():
    run_ranks(_sp_attention_worker, 2)
