"""DeepSpeed ZeRO-2 and ZeRO-3 with the plan's mpu, TP x SP of the GR00T N1.6 model on 4 real gloo
ranks, and hybrid sharding (ZeRO-3 inside SP, compressed sync across 2 DP replicas): the gathered
gradients, the global gradient norm and the parameters after two optimizer steps equal the
single-process reference; DeepSpeed's own collectives are counted on the shard group
(patch_torch_distributed)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel import comm, plan
from loongforge.train.parallel.compression import CompressionConfig, TopKCompressor
from loongforge.train.parallel.sequence_parallel import SequenceParallel
from loongforge.train.parallel.tensor_parallel import apply_tensor_parallel
from loongforge.train.parallel.video_sp import apply_video_sequence_parallel
from loongforge.train.parallel.zero import compressed_dp_sync, partition_zero3, zero_loss_scale
from tests.train.n16 import build, make_inputs
from tests.train.parallel.dist_helpers import gather_tp_tensor, run_ranks

LR, STEPS = 0.1, 2


def _rel(a, b) -> float:
    """Relative error; a gradient that is 0 up to rounding (key biases) is compared against fp32's floor."""
    err = (a - b).norm()
    return 0.0 if err < 1e-9 else (err / b.norm().clamp_min(1e-12)).item()


def _step_inputs(step: int, state):
    """(inputs, noise, u, denominator) of this DP replica's rows and the full batch's reference."""
    inputs, noise, u = make_inputs(step)
    total = inputs["action_mask"].sum()
    d = state.size("dp")
    per, lo = 4 // d, state.rank_in("dp") * (4 // d)
    mine = {k: (v[lo * 3:(lo + per) * 3] if k == "pixel_values" else v[lo:lo + per]) for k, v in inputs.items()}
    return (inputs, noise, u, total), (mine, noise[lo:lo + per], u[lo:lo + per], total / d)


def _engine(model, state, stage: int):
    import deepspeed

    zero = {"stage": stage}
    conf = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // state.size("dp"),
            "gradient_accumulation_steps": 1, "gradient_clipping": 1e6,  # computed, never binding
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    if stage == 3:
        partition_zero3(model, state, conf)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf, mpu=state)
    return engine, zero_loss_scale(zero, state)


def _zero_worker(rank: int, world: int, tp: int, sp: int, stage: int) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    state = plan.initialize(plan.ParallelPlan(tp=tp, sp=sp, zero_shard="sp" if stage == "hybrid" else "sp_dp"),
                            verbose=False)
    compressor = None
    if stage == "hybrid":  # ZeRO-3 inside SP, DP replicas synced by the compressor (exact at density 1)
        stage, compressor = 3, TopKCompressor(CompressionConfig(density=1.0, mode="sparse"), state.group("dp"))
    ref = build()
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, state)
    seqp = SequenceParallel(state)
    zero = {"stage": stage}
    apply_video_sequence_parallel(model, seqp, zero_divisor=zero_loss_scale(zero, state))
    engine, _ = _engine(model, state, stage)
    counter = comm.CommCounter()
    tp_group = state.group("tp")
    trained = [(n, p) for n, p in ref.named_parameters() if p.requires_grad and "vision_model.head" not in n]
    for step in range(STEPS):
        whole, mine = _step_inputs(step, state)
        ref.zero_grad()
        ref(*whole)["loss"].backward()
        with comm.patch_torch_distributed(counter):
            engine.backward(engine(*mine)["loss"])
            if compressor is not None:
                compressed_dp_sync(model, compressor)
            counter.step()
        ours = dict(model.named_parameters())
        for name, pr in trained:
            full = gather_tp_tensor(ours[name], safe_get_full_grad(ours[name]), tp_group)
            assert _rel(full, pr.grad) < 1e-5, (stage, step, name, _rel(full, pr.grad))
        engine.step()
        ref_norm = torch.sqrt(sum((p.grad ** 2).sum() for _, p in trained))
        assert _rel(torch.tensor(float(engine.get_global_grad_norm())), ref_norm) < 1e-5
        with torch.no_grad():
            for _, p in trained:
                p -= LR * p.grad
        for name, pr in trained:
            got = gather_tp_tensor(ours[name], safe_get_full_fp32_param(ours[name]), tp_group)
            assert _rel(got, pr) < 1e-5, (stage, name)
    groups = counter.by_group()
    shard = state.plan.zero_shard
    assert groups[shard]["wire_bytes"] > 0  # ZeRO's gradient reduction runs over its shard group
    if compressor is not None:
        _check_default_compression_bytes(engine, model, state)
    if rank == 0:
        print(f"ZeRO-{stage} tp={tp} sp={sp}\n{counter.report()}", flush=True)
    plan.destroy()


def _check_default_compression_bytes(engine, model, state) -> None:
    """One more step with the default compressor: what crosses the DP group is ~1/3 of dense."""
    counter = comm.CommCounter()
    compressor = TopKCompressor(CompressionConfig(), state.group("dp"))
    _, mine = _step_inputs(9, state)
    engine.backward(engine(*mine)["loss"])
    with comm.counting(counter):
        compressed_dp_sync(model, compressor)
    engine.step()
    assert counter.wire[("dp", "all_gather_into_tensor")] == compressor.sent_bytes > 0
    assert compressor.sent_bytes <= compressor.dense_equivalent / 3 + 1e-6


# ZeRO-2 (sum over SP already, scale 1) runs in `make parallel-full`; ZeRO-3 and hybrid over TP 2 x SP 2
# (4 DeepSpeed ranks, ~50 s on the 2-core CI box) in `make test-full`. make test keeps the trainer's own
# TP 2 + ZeRO-3 (test_tensor_parallel_train.py) and SP 2 + ZeRO-3 (test_sequence_parallel_train.py) runs.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.parallel_full), pytest.param(3, marks=pytest.mark.full),
                                   pytest.param("hybrid", marks=pytest.mark.full)])
def test_zero_with_tp_sp_matches_single_process(stage):
    tp, sp = (1, 2) if stage == "hybrid" else (2, 2)  # hybrid: 2 SP x 2 DP replicas
    run_ranks(_zero_worker, 4, tp, sp, stage, timeout=400)


def test_zero3_refuses_reduce_scatter_off():
    state = type("S", (), {"size": lambda self, kind: 2})()
    assert zero_loss_scale({"stage": 2}, state) == 1.0
    assert zero_loss_scale({"stage": 3}, state) == 2.0
    with pytest.raises(ConfigError, match="reduce_scatter"):
        zero_loss_scale({"stage": 3, "reduce_scatter": False}, state)


def _parallelize_bf16_worker(rank: int, world: int, topk: bool) -> None:
    """parallelize() of a bf16 ZeRO-3 run, plain (built under zero.Init) or hybrid (built, then partitioned
    over the shard group): the dtype of every parameter DeepSpeed trains, and which ones it keeps whole."""
    import deepspeed

    from loongforge.train.config import DataConfig, ParallelConfig, RunConfig, TrainConfig
    from loongforge.train.parallel.engine import align_ds_accelerator, skip_cpu_shm_op
    from loongforge.train.parallel.parallelize import parallelize

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    align_ds_accelerator(torch.device("cpu"))
    skip_cpu_shm_op(deepspeed)
    cfg = TrainConfig(data=DataConfig(root="/x", global_batch_size=4), run=RunConfig(run_dir="/r"),
                      parallel=ParallelConfig(zero_stage=3, precision="bf16",
                                              grad_compression="topk" if topk else "none"))
    state = plan.initialize(plan.plan_of(cfg), verbose=False)
    assert plan.is_hybrid(state) == topk
    built = parallelize(build, cfg, state, device=torch.device("cpu"))
    params = dict(built.engine.module.named_parameters())
    wrong = {n: p.ds_tensor.dtype for n, p in params.items() if p.ds_tensor.dtype != torch.bfloat16}
    assert not wrong, f"not bf16 after ZeRO-Init ({'hybrid' if topk else 'plain'}): {wrong}"
    # Persistence: every vector (norm weights, biases) stays gathered; the matrices are partitioned.
    threshold = built.ds_config["zero_optimization"]["stage3_param_persistence_threshold"]
    vectors = {n for n, p in params.items() if len(p.ds_shape) == 1}
    assert vectors and {n for n in vectors if not p_persist(params[n])} == set(), threshold
    largest = max(params.values(), key=lambda p: p.ds_numel)
    assert not p_persist(largest) and threshold == max(params[n].ds_numel for n in vectors)
    plan.destroy()


def p_persist(p) -> bool:
    return bool(getattr(p, "ds_persist", False))


# plain was right before the cast was added (DeepSpeed casts a model it partitions itself): make test-full
@pytest.mark.parametrize("topk", [pytest.param(False, marks=pytest.mark.full), True], ids=["plain", "hybrid"])
def test_zero3_trains_bf16_parameters_and_keeps_vectors_gathered(topk):
    """A ZeRO-3 run with bf16 on must train bf16 parameters on every layout: DeepSpeed skips its own
    cast for a model partitioned before deepspeed.initialize (the hybrid / TP / SP path), which then
    trained in fp32. And norm weights and biases are kept gathered (a persistence threshold of 0
    gathered and freed each of them in every layer, every step)."""
    run_ranks(_parallelize_bf16_worker, 1, topk)
