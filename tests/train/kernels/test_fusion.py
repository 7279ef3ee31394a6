"""Block fusion via torch.compile (train/kernels/fusion.py): policy, equivalence with eager (CPU with
the aot_eager backend: dynamo + AOTAutograd, no C++ build), composition with AC; inductor on GPU."""

import copy

import pytest
import torch

from loongforge.train.kernels import fusion, checkpointing as memory
from loongforge.train.config import ModelConfig
from loongforge.train.model.model import VLAModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
    from loongforge.train.model import recipes
    from loongforge.train.model.build import build_model
    from loongforge.train.parallel.parallelize import apply_memory_policies

    cfg = TrainConfig(data=DataConfig(root="/x", global_batch_size=8), run=RunConfig(run_dir="/r"),
                      parallel=ParallelConfig(zero_stage=2, tp=tp, sp=sp))
    assert cfg.memory.fuse == "auto"
    torch._dynamo.reset()
    policies = apply_memory_policies(build_model(recipes.tiny()), cfg, torch.device("cuda", 0))
    assert bool(policies.fused) == fused, policies.fused


def _model_and_inputs(device="cpu", dtype=torch.float32, dim=64, b=2):
    torch.manual_seed(0)
    m = VLAModel(ModelConfig(dim=dim, depth=3, heads=4)).to(device, dtype)
    cfg = m.cfg
    g = torch.Generator().manual_seed(0)
    h, w = cfg.image_size
    batch = {"frames": {s: torch.rand(b, cfg.max_frames, 3, h, w, generator=g) for s in ("a", "b")},
             "state": torch.randn(b, cfg.max_frames, cfg.state_dim, generator=g),
             "action": torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g),
             "task_tokens": torch.randint(0, 256, (b, cfg.max_text_tokens), generator=g),
             "frame_mask": torch.tensor([[True, True], [True, False]]).repeat(b // 2, 1),
             "task_mask": torch.ones(b, cfg.max_text_tokens, dtype=torch.bool),
             "action_valid": torch.ones(b, cfg.action_horizon, dtype=torch.bool),
             "sample_valid": torch.ones(b, dtype=torch.bool)}
    move = lambda x: {k: move(v) for k, v in x.items()} if isinstance(x, dict) else x.to(device)  # noqa: E731
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g)
    return m, (move(batch), noise.to(device), torch.rand(b, generator=g).to(device))


def _loss_and_grads(m, args):
    m.zero_grad(set_to_none=True)
    loss = m(*args)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_fused_equals_eager_and_composes_with_ac():
    torch._dynamo.reset()
    ref, args = _model_and_inputs()
    m = copy.deepcopy(ref)
    assert fusion.apply_fusion(m, backend="aot_eager") == [  # every block list of the model
        "blocks.0", "blocks.1", "blocks.2", "head_blocks.0", "head_blocks.1", "bin_blocks.0", "bin_blocks.1"]
    compiled = m.blocks[0].forward
    want_loss, want = _loss_and_grads(ref, args)
    for every in (0, 1):  # fused alone, then AC wrapping the compiled forwards
        memory.apply_ac(m, every)
        loss, got = _loss_and_grads(m, args)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    memory.apply_ac(m, 0)
    assert m.blocks[0].forward is compiled  # removing AC keeps the fusion


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
def test_flash_under_fusion_compiles_each_block_variant_once_over_varying_batches(monkeypatch):
    """20 batches whose valid text and frame counts vary (so flash-attn's packed token total and
    max_seqlen change every batch), blocks fused with aot_eager, flash-attn replaced by the CPU
    stand-in of test_attention: every block variant compiles in the first batch and nothing after
    (bound: 16 graphs in all, none new after batch 1). Traced, the varlen bookkeeping recompiled
    the blocks each batch until dynamo's recompile limit (8) sent them back to eager."""
    from torch._dynamo.utils import counters

    from loongforge.train.model import attention as attn
    from tests.train.model.test_attention import FakeFlash

    monkeypatch.setattr(attn, "flash_unusable", lambda *a, **k: (FakeFlash, None))
    monkeypatch.setattr(attn, "_gpu", lambda device: "CPU stand-in")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = VLAModel(ModelConfig(dim=32, depth=2, heads=2, attention="flash"))
    _, (batch, noise, t) = _model_and_inputs(b=2)
    fusion.apply_fusion(m, backend="aot_eager")
    g, graphs = torch.Generator().manual_seed(1), []
    text, frames = batch["task_mask"].shape[1], batch["frame_mask"].shape[1]
    for _ in range(20):
        b = dict(batch, task_mask=torch.arange(text)[None] < torch.randint(1, text + 1, (2, 1), generator=g),
                 frame_mask=torch.rand(2, frames, generator=g) < 0.7)
        b["frame_mask"][:, -1] = True
        m(b, noise, t)["loss"].backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[-1] == graphs[0] <= 16, graphs


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def test_frame_buckets_under_fusion_stop_recompiling():
    """Batches cycling through 4 frame counts (the loader's buckets: another token count each).
    With dynamic=False each bucket was a graph per block variant, shared by all blocks of a class
    against one recompile limit (8): it was hit and blocks ran eager. Automatic dynamic shapes:
    no new graph once each bucket was seen (a size-1 dimension stays specialized), fewer than 24 in
    all, and the limit is never hit (made an error here: past it dynamo silently runs eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, depth=2, heads=2, max_frames=4)
    m = VLAModel(cfg)
    fusion.apply_fusion(m, backend="aot_eager")
    g, graphs, (h, w), b = torch.Generator().manual_seed(1), [], cfg.image_size, 2
    for i in range(20):
        n = 1 + i % 4
        batch = {"frames": {s: torch.rand(b, n, 3, h, w, generator=g) for s in ("a", "b")},
                 "state": torch.randn(b, n, cfg.state_dim, generator=g),
                 "action": torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g),
                 "task_tokens": torch.randint(0, 256, (b, cfg.max_text_tokens), generator=g),
                 "frame_mask": torch.ones(b, n, dtype=torch.bool),
                 "task_mask": torch.ones(b, cfg.max_text_tokens, dtype=torch.bool),
                 "action_valid": torch.ones(b, cfg.action_horizon, dtype=torch.bool),
                 "sample_valid": torch.ones(b, dtype=torch.bool)}
        noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g)
        m(batch, noise, torch.rand(b, generator=g))["loss"].backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[-1] == graphs[7] < 24, graphs  # settled: nothing new in the last 12 batches
