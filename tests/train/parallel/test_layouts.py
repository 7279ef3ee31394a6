"""The correctness matrix: (TP, SP, DP) layouts on real gloo processes give the
single-process reference's loss and gathered gradients within 1e-5 (fp32),
over 3 SGD steps; the communication counter sees exactly the collectives the
layout implies. 8-process layouts are @slow (`make parallel-full`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.sequence_parallel import SequenceParallel, apply_sequence_parallel
from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
from tests.train.parallel.dist_helpers import TinyModel, gather_tp_tensor, make_batch, run_ranks

STEPS, DEPTH, LR = 3, 2, 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _sync_grads(model, state) -> None:
    """What ZeRO does over sp_dp, spelled out: SP ranks sum (disjoint tokens), DP replicas average."""
    for p in model.parameters():
        dist.all_reduce(p.grad, group=state.group("sp_dp"))
        p.grad /= state.size("dp")


def _check_step(model, ref, loss, ref_loss, state, step) -> None:
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=state.group("dp"))
    mean /= state.size("dp")
    assert _rel(mean, ref_loss.detach()) < 1e-5, (step, mean.item(), ref_loss.item())
    for (name, p), (ref_name, pr) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name
        full = gather_tp_tensor(p, p.grad, state.group("tp"))
        assert _rel(full, pr.grad) < 1e-5, (step, name, _rel(full, pr.grad))


def _layout_worker(rank: int, world: int, tp: int, sp: int) -> None:
    state = plan.initialize(plan.ParallelPlan(tp=tp, sp=sp))
    torch.manual_seed(0)
    ref = TinyModel(depth=DEPTH)
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, state)
    seqp = SequenceParallel(state)
    apply_sequence_parallel(model, seqp)
    counter = comm.CommCounter()
    dp, per = state.rank_in("dp"), 4 // state.size("dp")
    for step in range(STEPS):
        x, mask, target, n_video = make_batch(step)
        ref.zero_grad()
        ref_loss = ref(x, mask, target)
        ref_loss.backward()
        mine = slice(dp * per, (dp + 1) * per)
        xl, maskl = seqp.split(x[mine], n_video, mask[mine])
        model.zero_grad()
        with comm.counting(counter):
            loss = model(xl, maskl, target[mine])
            loss.backward()
        counter.step()
        _sync_grads(model, state)
        _check_step(model, ref, loss, ref_loss, state, step)
        with torch.no_grad():
            for p in [*model.parameters(), *ref.parameters()]:
                p -= LR * p.grad
    _check_counts(counter, tp, sp)
    if rank == 0:
        print(counter.report(), flush=True)
    plan.destroy()


def _check_counts(counter: comm.CommCounter, tp: int, sp: int) -> None:
    groups = counter.by_group()
    # TP: all-reduce after proj and fc2 (forward), before qkv and fc1 (backward).
    assert groups.get("tp", {}).get("calls", 0) == (4 * DEPTH if tp > 1 else 0)
    if sp > 1:  # Ulysses: 2 all-to-alls per block each way; replicated heads: 1 all-gather each way
        assert counter.calls[("sp", "all_to_all_single")] == 4 * DEPTH * STEPS
        assert counter.calls[("sp", "all_gather_into_tensor")] == 2 * DEPTH * STEPS
    else:
        assert "sp" not in groups
    assert "dp" not in groups and "world" not in groups  # gradient sync is outside the counted region


FAST = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]
FULL = [(2, 2, 2), (2, 1, 4), (1, 2, 4), (1, 4, 2), (4, 1, 2)]


@pytest.mark.parametrize("tp,sp,dp", FAST)
def test_layout_matches_single_process(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp)


@pytest.mark.slow
@pytest.mark.parallel_full
@pytest.mark.parametrize("tp,sp,dp", FULL)
def test_layout_matches_single_process_8_ranks(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp, timeout=600)
