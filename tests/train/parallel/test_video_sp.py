"""The GR00T N1.6 model under its parallel plan (TP, SP on the video tokens, DP; ZeRO-3 through
DeepSpeed), on real gloo processes: the single-process loss and gathered gradients within 1e-5
(fp32) over several SGD steps. The batch is what the processor hands the model: left-padded chat
prompts of different lengths with 3 images x 6 image tokens each (18 image tokens per row: the
LLM's video span pads at S = 4), 84 x 56 images (24 patches, the image batch pads when a replica's
images do not split S ways: DP 2 x SP 4), state, action and a partial action mask. 8-process layouts: `make parallel-full`. Through DeepSpeed's
ZeRO-3 with the plan's mpu: test_zero.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from loongforge.train.model.model import Gr00tN1d6
from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.sequence_parallel import SequenceParallel
from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
from loongforge.train.parallel.video_sp import apply_video_sequence_parallel
from tests.train.n16 import CFG, make_inputs
from tests.train.parallel.dist_helpers import gather_tp_tensor, run_ranks

STEPS, LR, B, V = 4, 0.05, 4, 3


def _rel(a, b) -> float:
    """Relative error; a tensor whose true gradient is 0 up to rounding (key biases: softmax ignores a
    shift of every key) is compared absolutely, against the rounding floor of fp32."""
    err = (a - b).norm()
    return 0.0 if err < 1e-9 else (err / b.norm().clamp_min(1e-12)).item()


def _rows(inputs: dict, lo: int, hi: int) -> dict:
    return {k: (v[lo * V:hi * V] if k == "pixel_values" else v[lo:hi]) for k, v in inputs.items()}


def _models(state):
    torch.manual_seed(0)
    ref = Gr00tN1d6(CFG, attention="sdpa")
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, state)
    return ref, model


def _check_grads(named, ref, grad_of, tp_group, step) -> None:
    for (name, p), (ref_name, pr) in zip(named, ref.named_parameters(), strict=True):
        assert name == ref_name
        if pr.grad is None:  # never used: the vision pooling head
            assert grad_of(p) is None or float(grad_of(p).abs().max()) == 0.0, name
            continue
        full = gather_tp_tensor(p, grad_of(p), tp_group)
        assert _rel(full, pr.grad) < 1e-5, (step, name, _rel(full, pr.grad))


def _layout_worker(rank: int, world: int, tp: int, sp: int) -> None:
    state = plan.initialize(plan.ParallelPlan(tp=tp, sp=sp), verbose=False)
    ref, model = _models(state)
    apply_video_sequence_parallel(model, SequenceParallel(state), zero_divisor=1.0)  # the sync below sums SP
    counter = comm.CommCounter()
    d, per = state.size("dp"), B // state.size("dp")
    lo = state.rank_in("dp") * per
    for step in range(STEPS):
        inputs, noise, u = make_inputs(step)
        ref.zero_grad()
        total = inputs["action_mask"].sum()
        ref_loss = ref(inputs, noise, u, total)["loss"]
        ref_loss.backward()
        model.zero_grad()
        with comm.counting(counter):
            loss = model(_rows(inputs, lo, lo + per), noise[lo:lo + per], u[lo:lo + per], total / d)["loss"]
            loss.backward()
        counter.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=state.group("dp"))
        assert _rel(mean / d, ref_loss.detach()) < 1e-5, (step, mean.item() / d, ref_loss.item())
        for p in model.parameters():  # what ZeRO does over sp_dp: SP ranks sum, DP replicas average
            if p.grad is not None:
                dist.all_reduce(p.grad, group=state.group("sp_dp"))
                p.grad /= d
        _check_grads(model.named_parameters(), ref, lambda p: p.grad, state.group("tp"), step)
        with torch.no_grad():
            for p in [*model.parameters(), *ref.parameters()]:
                if p.grad is not None:
                    p -= LR * p.grad
    _check_counts(counter, tp, sp)
    plan.destroy()


def _check_counts(counter, tp: int, sp: int) -> None:
    """The collectives each layout implies, per step."""
    groups = counter.by_group()
    lv, ll, ld = CFG.vision.num_hidden_layers, CFG.select_layer, CFG.dit.num_layers
    # TP forward: an all-reduce after every row-parallel linear (attention output, MLP output) of every
    # block. Backward: one per input entering a TP region (the vision and LLM attention and MLP, the DiT's
    # FF and attention, whose cross blocks take the features as a second input) and one per Qwen3 q/k
    # norm gradient.
    forward = 2 * (lv + ll + ld)
    backward = 2 * lv + 2 * ll + 2 * ll + ld + (ld // 2) * 1 + (ld // 2) * 2
    got = groups.get("tp", {}).get("calls", 0)
    assert got == (forward + backward if tp > 1 else 0), (got, forward, backward)  # per step
    if sp > 1:  # Ulysses per LLM layer: q, k, v and the output, all-to-all each way
        assert counter.calls[("sp", "all_to_all_single")] == 2 * 4 * ll * STEPS
    else:
        assert "sp" not in groups
    assert "dp" not in groups  # gradient sync is outside the counted region


def test_split_reorders_and_pads_image_tokens():
    """Image tokens first (per row: left padding moves them), padded to a multiple of S, rest replicated;
    merge restores the original order."""
    from types import SimpleNamespace

    seqp = SequenceParallel.__new__(SequenceParallel)
    seqp.group, seqp.size, seqp.rank, seqp.layout = None, 3, 1, None
    video = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    seq = torch.arange(14.0).view(2, 7, 1)
    pos = torch.arange(7)[None].expand(2, 7)
    local, lpos = seqp.split(seq, pos, video)
    lay = seqp.layout
    assert (lay.n_video, lay.n_local, lay.n_rep) == (4, 2, 3)  # 4 image tokens pad to 6
    assert local[0].flatten().tolist() == [4.0, 5.0, 0.0, 3.0, 6.0]  # rank 1: image tokens 3-4 of row 0, the rest
    assert lpos[1].tolist() == [5, 6, 2, 3, 4]
    full = torch.cat([torch.zeros(2, 6, 1), local[:, 2:]], dim=1)  # what rank order gives back, pads included
    order = torch.gather(torch.cat([torch.zeros(2, 6, 1), seq.gather(1, lay.to_perm[:, 6:, None])], 1), 1,
                         lay.to_orig[..., None])
    assert torch.equal(order[:, ~video[0]][0], seq[0, ~video[0]])
    assert full.shape[1] == lay.to_perm.shape[1]
    _ = SimpleNamespace


FAST = [(1, 2, 1), (2, 1, 1), (1, 4, 1)]
FULL = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp,dp", FAST)
def test_n16_layout_matches_single_process(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp)


@pytest.mark.slow
@pytest.mark.parallel_full
@pytest.mark.parametrize("tp,sp,dp", FULL)
def test_n16_layout_matches_single_process_full(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp, timeout=600)
