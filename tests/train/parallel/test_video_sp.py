"""Sequence parallel on the real VLA model's video tokens (train/parallel/video_sp.py): (TP, SP,
DP) layouts on real gloo processes give the single-process loss and gathered gradients within
1e-5 (fp32) over 3 SGD steps; ZeRO-3 with TP x SP through DeepSpeed does too. The video span
(1 camera x 3 frames x 9 tokens = 27) pads at S = 2 and 4, and one sample has 1 real frame of 3,
so pad tokens and padded frames are both masked. 8-process layouts: `make parallel-full`."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from loongforge.train.model import mask as masks
from loongforge.train.config import ModelConfig
from loongforge.train.model.model import VLAModel
from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.sequence_parallel import SequenceParallel, SPLayout, pad_mask
from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
from loongforge.train.parallel.video_sp import apply_video_sequence_parallel, padded_layout
from loongforge.train.parallel.zero import partition_zero3, zero_loss_scale
from tests.train.parallel.dist_helpers import gather_tp_tensor, run_ranks

STEPS, LR, B = 3, 0.05, 4
CFG = ModelConfig(dim=48, depth=2, head_depth=2, bin_depth=2, heads=4, patch=4, vision_tokens=9, action_bins=16,
                  attention="sdpa", image_size=(12, 12), cameras=1, max_frames=3, state_dim=5, action_dim=3,
                  action_horizon=4, max_text_tokens=6)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def make_batch(step: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    k, h = CFG.max_frames, CFG.action_horizon
    frame_mask = torch.ones(B, k, dtype=torch.bool)
    frame_mask[1, 1:] = False  # a short episode: 1 real frame of 3
    task_mask = torch.ones(B, CFG.max_text_tokens, dtype=torch.bool)
    task_mask[2, 3:] = False
    batch = {"frames": {"cam0": torch.rand(B, k, 3, *CFG.image_size, generator=g)},
             "state": torch.randn(B, k, CFG.state_dim, generator=g),
             "task_tokens": torch.randint(0, CFG.vocab, (B, CFG.max_text_tokens), generator=g),
             "frame_mask": frame_mask, "task_mask": task_mask,
             "action": torch.randn(B, h, CFG.action_dim, generator=g),
             "action_valid": torch.ones(B, h, dtype=torch.bool), "sample_valid": torch.ones(B, dtype=torch.bool)}
    return batch, torch.randn(B, h, CFG.action_dim, generator=g), torch.rand(B, generator=g)


def _rows(batch: dict, rows: slice) -> dict:
    return {k: ({c: t[rows] for c, t in v.items()} if isinstance(v, dict) else v[rows]) for k, v in batch.items()}


def _models(state, sp):
    torch.manual_seed(0)
    ref = VLAModel(CFG)
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, state)
    return ref, model


def _check_grads(named, ref, grad_of, tp_group, step) -> None:
    for (name, p), (ref_name, pr) in zip(named, ref.named_parameters(), strict=True):
        assert name == ref_name
        full = gather_tp_tensor(p, grad_of(p), tp_group)
        assert _rel(full, pr.grad) < 1e-5, (step, name, _rel(full, pr.grad))


def _layout_worker(rank: int, world: int, tp: int, sp: int) -> None:
    state = plan.initialize(plan.ParallelPlan(tp=tp, sp=sp), verbose=False)
    seqp = SequenceParallel(state)
    ref, model = _models(state, seqp)
    apply_video_sequence_parallel(model, seqp, zero_divisor=1.0)  # the manual sync below sums over SP
    counter = comm.CommCounter()
    dp, per = state.rank_in("dp"), B // state.size("dp")
    for step in range(STEPS):
        batch, noise, u = make_batch(step)
        ref.zero_grad()
        ref_loss = ref(batch, noise, u)["loss"]
        ref_loss.backward()
        mine = slice(dp * per, (dp + 1) * per)
        model.zero_grad()
        with comm.counting(counter):
            loss = model(_rows(batch, mine), noise[mine], u[mine])["loss"]
            loss.backward()
        counter.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=state.group("dp"))
        assert _rel(mean / state.size("dp"), ref_loss.detach()) < 1e-5, (step, mean.item(), ref_loss.item())
        for p in model.parameters():  # what ZeRO does over sp_dp: SP ranks sum, DP replicas average
            dist.all_reduce(p.grad, group=state.group("sp_dp"))
            p.grad /= state.size("dp")
        _check_grads(model.named_parameters(), ref, lambda p: p.grad, state.group("tp"), step)
        with torch.no_grad():
            for p in [*model.parameters(), *ref.parameters()]:
                p -= LR * p.grad
    if sp > 1:  # Ulysses: 2 all-to-alls per trunk block each way; the merge: 1 all-gather forward (its
        # backward keeps my slice, no traffic)
        assert counter.calls[("sp", "all_to_all_single")] == 4 * CFG.depth * STEPS
        assert counter.calls[("sp", "all_gather_into_tensor")] == (2 * CFG.depth + 1) * STEPS
    plan.destroy()


def _zero3_worker(rank: int, world: int, tp: int, sp: int) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    state = plan.initialize(plan.ParallelPlan(tp=tp, sp=sp), verbose=False)
    seqp = SequenceParallel(state)
    ref, model = _models(state, seqp)
    zero = {"stage": 3}
    apply_video_sequence_parallel(model, seqp, zero_divisor=zero_loss_scale(zero, state))
    conf = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B // state.size("dp"),
            "gradient_accumulation_steps": 1, "gradient_clipping": 1e6, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    partition_zero3(model, state, conf)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=conf, mpu=state)
    dp, per = state.rank_in("dp"), B // state.size("dp")
    for step in range(2):
        batch, noise, u = make_batch(step)
        ref.zero_grad()
        ref_loss = ref(batch, noise, u)["loss"]
        ref_loss.backward()
        mine = slice(dp * per, (dp + 1) * per)
        loss = engine(_rows(batch, mine), noise[mine], u[mine])["loss"]
        assert _rel(loss.detach(), ref_loss.detach()) < 1e-5 or state.size("dp") > 1
        engine.backward(loss)
        _check_grads(model.named_parameters(), ref, safe_get_full_grad, state.group("tp"), step)
        engine.step()
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
    plan.destroy()


def test_padded_layout_matches_pad_mask():
    """The mask description the padded trunk uses == the dense pad_mask of the unpadded mask."""
    segs = masks.vl_segments(cameras=2, frames=3, tokens_per_frame=3, text_len=4)
    lengths = torch.tensor([[9, 9, 3, 4], [3, 3, 1, 2]])
    layout = masks.VLLayout(segs, lengths)
    want = pad_mask(masks.dense(masks.VLSelf(layout), "cpu"), SPLayout(18, 5, 7, 4))
    got = masks.dense(masks.VLSelf(padded_layout(layout, 18, 2)), "cpu")
    assert torch.equal(got, want)


def test_split_pads_and_refuses_what_it_cannot_shard():
    from types import SimpleNamespace

    from loongforge.shared.errors import ConfigError
    from loongforge.train.parallel.video_sp import VideoTokens

    sp = SimpleNamespace(size=2, rank=1, group=None, layout=None)  # no collective in split
    segs = masks.vl_segments(cameras=1, frames=3, tokens_per_frame=3, text_len=2)  # 9 video + 5 replicated
    layout = masks.VLLayout(segs, torch.tensor([[9, 3, 2]]))
    seq = torch.arange(14.0).view(1, 14, 1)
    local, mask = VideoTokens(sp).split(seq, 9, masks.VLSelf(layout))
    assert local.flatten().tolist() == [5, 6, 7, 8, 0, 9, 10, 11, 12, 13]  # my 5 video (4 real + 1 pad), then all rest
    assert [x.name for x in mask.layout.segments] == ["vision0", "sp_pad", "state", "text"]
    with pytest.raises(ConfigError, match="no padded form"):
        VideoTokens(sp).split(seq, 9, masks.Causal(14))
    with pytest.raises(ConfigError, match="segment boundary"):
        padded_layout(layout, 8, 2)
    with pytest.raises(ConfigError, match="trunk_tokens"):
        apply_video_sequence_parallel(torch.nn.Linear(2, 2), sp)


FAST = [(1, 2, 1), (2, 2, 1)]
FULL = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4), (1, 4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp,dp", FAST)
def test_video_sp_layout_matches_single_process(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp)


@pytest.mark.slow
@pytest.mark.full  # ~1 min on 4 DeepSpeed ranks; the trainer test covers ZeRO-3 x SP 2 in make test
def test_video_sp_zero3_tp2_sp2_matches_single_process():
    run_ranks(_zero3_worker, 4, 2, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.parallel_full
@pytest.mark.parametrize("tp,sp,dp", FULL)
def test_video_sp_layout_matches_single_process_full(tp, sp, dp):
    run_ranks(_layout_worker, tp * sp * dp, tp, sp, timeout=600)
