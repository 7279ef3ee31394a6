"""The plan's rank placement and groups (pure), its mpu on 4 gloo ranks, and
Ulysses attention over video tokens == full attention, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.sequence_parallel import SequenceParallel
from tests.train.parallel.dist_helpers import make_batch, run_ranks, sdpa


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
    with pytest.raises(ConfigError, match="heads"):
        plan.ParallelPlan(tp=2, sp=4).check_model(heads=4)


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
    state = plan.initialize(plan.ParallelPlan(sp=world), verbose=False)
    _, mask, _, n_video = make_batch(0)  # 7 video tokens: one pad on 2 ranks; sample 1 has 3 invalid frames
    g = torch.Generator().manual_seed(1)
    b, n = mask.shape[0], mask.shape[-1]
    q, k, v, w = (torch.randn(b, 4, n, 8, generator=g) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sdpa(*ref_in, mask)
    (ref * w).sum().backward()

    sp = SequenceParallel(state)
    # split works on (B, N, ...): move heads behind the sequence and back
    local = [sp.split(t.transpose(1, 2), n_video)[0].transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    _, padded_mask = sp.split(q.transpose(1, 2), n_video, mask)
    counter = comm.CommCounter()
    with comm.counting(counter):
        out = sp.attention(sdpa)(*local, padded_mask)
        w_local = sp.split(w.transpose(1, 2), n_video)[0].transpose(1, 2)
        (out * w_local).sum().backward()
    lay = sp.layout
    real = min(lay.n_local, n_video - rank * lay.n_local)  # my real (non-pad) video tokens
    mine = slice(rank * lay.n_local, rank * lay.n_local + real)

    def pick(t):  # my real video tokens and the replicated tokens of a full (B, H, N, Dh) tensor
        return torch.cat([t[:, :, mine], t[:, :, n_video:]], dim=2)

    def drop_pad(t):
        return torch.cat([t[:, :, :real], t[:, :, lay.n_local:]], dim=2)

    torch.testing.assert_close(drop_pad(out), pick(ref), rtol=1e-5, atol=1e-6)
    for x_local, x_ref in zip(local, ref_in):
        torch.testing.assert_close(drop_pad(x_local.grad), pick(x_ref.grad), rtol=1e-5, atol=1e-6)
    gathered = sp.gather_video(out.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(gathered, ref[:, :, :n_video], rtol=1e-5, atol=1e-6)
    assert counter.calls[("sp", "all_to_all_single")] == 4  # q|k|v and output, forward and backward
    plan.destroy()


def test_ulysses_attention_equals_full_attention_2_ranks():
    run_ranks(_sp_attention_worker, 2)
