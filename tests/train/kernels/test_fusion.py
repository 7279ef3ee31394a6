"""Block fusion via torch.compile (train/kernels/fusion.py) on GR00T N1.6's blocks (SigLIP2 encoder
layers, Qwen3 decoder layers, DiT blocks): policy, equivalence with eager (CPU with the aot_eager
backend: dynamo + AOTAutograd, no C++ build), composition with AC; inductor on GPU."""

import copy

import pytest
import torch

from loongforge.train.kernels import checkpointing as memory
from loongforge.train.kernels import fusion
from tests.train.n16 import CFG, build, make_inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCKS = (["backbone.model.vision_model.vision_model.encoder.layers.0",
           "backbone.model.vision_model.vision_model.encoder.layers.1"]
          + [f"backbone.model.language_model.model.layers.{i}" for i in range(CFG.select_layer)]
          + [f"action_head.model.transformer_blocks.{i}" for i in range(CFG.dit.num_layers)])


def test_policy():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not fusion.fusion_wanted("auto", cpu, 2, model_parallel=1)
    assert fusion.fusion_wanted("auto", gpu, 2, model_parallel=1)
    assert not fusion.fusion_wanted("auto", gpu, 3, model_parallel=1)
    assert not fusion.fusion_wanted("auto", gpu, 2, model_parallel=2)  # TP/SP collectives inside the blocks
    assert fusion.fusion_wanted("on", cpu, 3, model_parallel=1) and not fusion.fusion_wanted("off", gpu, 0,
                                                                                              model_parallel=1)


@pytest.mark.parametrize("tp, sp, fused", [(1, 1, True), (2, 1, False), (1, 2, False)])
def test_auto_fusion_is_off_under_tensor_or_sequence_parallel(tp, sp, fused):
    """`--fuse auto` on CUDA compiled the blocks of a TP/SP run too, whose forwards hold the TP
    all-reduce and the Ulysses all-to-alls: graph breaks, and a recompile per layout. Checked
    through parallelize's policy step on a CUDA device name (compiling is lazy: nothing runs)."""
    from loongforge.train.config import DataConfig, ParallelConfig, RunConfig, TrainConfig
    from loongforge.train.parallel.parallelize import apply_memory_policies

    cfg = TrainConfig(data=DataConfig(root="/x", global_batch_size=8), run=RunConfig(run_dir="/r"),
                      parallel=ParallelConfig(zero_stage=2, tp=tp, sp=sp))
    assert cfg.memory.fuse == "auto"
    torch._dynamo.reset()
    policies = apply_memory_policies(build(), cfg, torch.device("cuda", 0))
    assert bool(policies.fused) == fused, policies.fused


def _loss_and_grads(m, args):
    m.zero_grad(set_to_none=True)
    loss = m(*args)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_fused_equals_eager_and_composes_with_ac():
    torch._dynamo.reset()
    ref = build()
    args = make_inputs(0)
    m = copy.deepcopy(ref)
    assert fusion.apply_fusion(m, backend="aot_eager") == BLOCKS  # every block of every tower
    compiled = m.action_head.model.transformer_blocks[0].forward
    want_loss, want = _loss_and_grads(ref, args)
    for every in (0, 1):  # fused alone, then AC wrapping the compiled forwards
        memory.apply_ac(m, every)
        loss, got = _loss_and_grads(m, args)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    memory.apply_ac(m, 0)
    assert m.action_head.model.transformer_blocks[0].forward is compiled  # removing AC keeps the fusion


@pytest.mark.gpu
@cuda
def test_gpu_inductor_equivalence_and_kernel_time(train_root):
    from torch.profiler import ProfilerActivity, profile

    from tests.train.gpu_model import loss_and_grads, model_and_inputs

    torch._dynamo.reset()
    ref, args = model_and_inputs(train_root[0], "tiny", device="cuda", dtype=torch.bfloat16, batch_size=8)
    m = copy.deepcopy(ref)
    assert fusion.apply_fusion(m)
    want_loss, want = loss_and_grads(ref, args)
    loss, got = loss_and_grads(m, args)
    torch.testing.assert_close(loss.float(), want_loss.float(), rtol=2e-2, atol=2e-2)

    def kernels(model):
        for _ in range(3):
            loss_and_grads(model, args)  # compile and warm up outside the trace
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loss_and_grads(model, args)
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(evs), sum(e.device_time for e in evs)

    n_eager, t_eager = kernels(ref)
    n_fused, t_fused = kernels(m)
    print(f"fusion: kernels {n_eager} -> {n_fused}, kernel time {t_eager:.0f} -> {t_fused:.0f} us "
          f"(ratio {t_fused / t_eager:.2f})")
    assert n_fused < n_eager


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
@pytest.mark.full  # CPU torch.compile (19 s); test_fused_equals_eager_and_composes_with_ac stays
def test_flash_under_fusion_compiles_each_block_variant_once_over_varying_batches(monkeypatch):
    """8 batches whose prompts are padded differently (flash-attn's packed token total and max_seqlen
    change every batch), blocks fused with aot_eager, flash-attn replaced by the CPU stand-in of
    test_attention: the graphs settle after the first batches and nothing new compiles after (traced,
    the varlen bookkeeping recompiled the blocks each batch until dynamo's recompile limit sent them
    back to eager)."""
    from torch._dynamo.utils import counters

    from loongforge.train.model import attention as attn
    from tests.train.model.test_attention import FakeFlash

    monkeypatch.setattr(attn, "flash_unusable", lambda *a, **k: (FakeFlash, None))
    monkeypatch.setattr(attn, "_gpu", lambda device: "CPU stand-in")
    torch._dynamo.reset()
    counters.clear()
    m = build(attention="flash")
    fusion.apply_fusion(m, backend="aot_eager")
    inputs, noise, u = make_inputs(0, b=2, v=1, hw=(56, 56))
    g, graphs = torch.Generator().manual_seed(1), []
    for _ in range(8):
        b = dict(inputs, attention_mask=inputs["attention_mask"].clone())
        pad = int(torch.randint(0, 3, (1,), generator=g))
        b["attention_mask"][1, :pad] = 0  # more left padding in row 1, a different packed total
        m(b, noise, u)["loss"].backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[-1] == graphs[3], graphs


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
@pytest.mark.full  # CPU torch.compile (30 s); fusion is on by default on CUDA only: gpu-check runs it
def test_prompt_and_image_counts_under_fusion_stop_recompiling():
    """Batches cycling twice through 4 shapes (longer prompts and more images per sample: the frame count of
    a run with history). With dynamic=False each shape was a graph per block variant against one
    recompile limit per code object: it was hit and blocks ran eager. Automatic dynamic shapes: no new
    graph once each shape was seen, and the limit is never hit (made an error here)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = build()
    fusion.apply_fusion(m, backend="aot_eager")
    graphs = []
    for i in range(8):
        inputs, noise, u = make_inputs(i, b=2, v=1 + i % 4, hw=(56, 56), extra_text=3 * (i % 4))
        m(inputs, noise, u)["loss"].backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[-1] == graphs[3], graphs  # settled once each shape was seen: nothing new in the second cycle
