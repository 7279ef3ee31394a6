"""FP8 / BF16 policies (train/kernels/precision.py): the module swap and its filter, the warm-up
schedule, the refusals; numerics on a GPU (`make gpu-check`)."""

import copy
import sys

import pytest
import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.kernels import precision


# NOTE: not a module-level importorskip: that turned the GPU tests below into skips on a machine
# without torchao, where they must fail and say what is missing. The CPU tests that swap in
# Float8Linear skip without the fp8 extra (`make test` installs it).
try:
    from torchao.float8.float8_linear import Float8Linear
except ImportError:
    Float8Linear = None
NO_TORCHAO = "torchao is not installed (the fp8 extra; the GPU bundle carries the torchao built for its torch)"
needs_torchao = pytest.mark.skipif(Float8Linear is None, reason=NO_TORCHAO)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _require_torchao() -> None:
    if Float8Linear is None:
        pytest.fail(NO_TORCHAO)


def _model(depth=4, dim=64):
    """The reduced N1.6 with a DiT of `depth` blocks `dim` wide (its vision tower and LLM keep the tiny
    recipe's 2 layers each: no inner block, no FP8 there)."""
    from tests.train.n16 import CFG, build

    return build(CFG.replace(dit={"num_layers": depth, "num_attention_heads": 4, "attention_head_dim": dim // 4,
                                  "output_dim": dim}, input_embedding_dim=dim, hidden_size=dim))


def _inputs(model, b=2):
    from tests.train.n16 import make_inputs

    return make_inputs(0, b=b, v=1, hw=(56, 56), cfg=model.cfg)


DIT = "action_head.model.transformer_blocks."


def test_train_dtype():
    assert precision.train_dtype(torch.device("cpu")) is torch.float32
    assert precision.train_dtype(torch.device("cuda")) is torch.bfloat16
    assert precision.train_dtype(torch.device("cpu"), "bf16") is torch.bfloat16
    assert precision.train_dtype(torch.device("cuda"), "fp32") is torch.float32


@needs_torchao
def test_filter_converts_inner_blocks_only_same_params_and_names():
    m = _model(depth=4)
    params = {n: p for n, p in m.named_parameters()}
    keys = list(m.state_dict())
    names = precision.convert_fp8(m, min_features=16)
    assert names and all(n.startswith((DIT + "1.", DIT + "2.")) for n in names)
    inner = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and n.startswith((DIT + "1.", DIT + "2."))
             and ".norm" not in n]
    assert sorted(names) == sorted(inner)  # every GEMM of the inner blocks (dims are multiples of 16)
    assert DIT + "1.norm1.linear" not in names  # the adaptive norm's modulation: one row per sample
    blocks = m.action_head.model.transformer_blocks
    assert not isinstance(m.action_head.model.proj_out_2, Float8Linear)
    assert not isinstance(blocks[0].attn1.to_q, Float8Linear)
    assert list(m.state_dict()) == keys  # a BF16 checkpoint loads unchanged
    assert all(p is params[n] for n, p in m.named_parameters())  # ZeRO sees the same tensors


@needs_torchao
def test_filter_skips_small_and_unaligned_gemms():
    m = _model(depth=4)
    assert precision.convert_fp8(copy.deepcopy(m), min_features=256) == []  # dim 64 < 256: all small
    keep = precision.fp8_filter(m, min_features=16)
    blocks = m.action_head.model.transformer_blocks
    assert keep(blocks[1].attn1.to_q, DIT + "1.attn1.to_q")
    assert not keep(nn.Linear(64, 72), DIT + "1.attn1.to_q")  # 72 % 16 != 0
    assert not keep(nn.Linear(64, 8), DIT + "1.attn1.to_q")  # below the size floor
    assert not keep(m.action_head.model.proj_out_2, "action_head.model.proj_out_2")
    assert not keep(blocks[3].attn1.to_out[0], DIT + "3.attn1.to_out.0")  # the last block
    assert not keep(nn.LayerNorm(64), DIT + "1.norm1")


@needs_torchao
def test_warmup_schedule_blend_and_switch():
    m = _model()
    precision.convert_fp8(m, min_features=16)
    w = precision.Fp8Warmup(m, steps=4, mode="blend")
    assert [w.fraction(s) for s in range(10, 16)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]  # counts from step 10
    s = precision.Fp8Warmup(m, steps=4, mode="switch")
    assert [s.fraction(x) for x in range(3, 9)] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert precision.Fp8Warmup(m, steps=0).fraction(7) == 1.0
    with pytest.raises(ConfigError):
        precision.Fp8Warmup(m, steps=2, mode="sometimes")


@needs_torchao
def test_warmup_blend_is_high_precision_then_fp8_exactly():
    ref = _model()
    m = copy.deepcopy(ref)
    precision.convert_fp8(m, min_features=16)
    pure = copy.deepcopy(m)  # Float8Linear without warm-up
    args = _inputs(ref)
    w = precision.Fp8Warmup(m, steps=2)
    assert w.on_step(0) == 0.0
    torch.testing.assert_close(m(*args)["loss"], ref(*args)["loss"], rtol=0, atol=0)  # a = 0: plain linear
    assert w.on_step(1) == 0.5
    half = m(*args)["loss"]
    assert w.on_step(2) == 1.0
    assert all("forward" not in mod.__dict__ for mod in w.modules)  # blend removed: Float8Linear alone
    fp8 = m(*args)["loss"]
    torch.testing.assert_close(fp8, pure(*args)["loss"], rtol=0, atol=0)
    assert fp8 != ref(*args)["loss"] and half not in (fp8, ref(*args)["loss"])  # FP8 really quantizes
    half.backward()  # the blend trains through both paths
    assert m.action_head.model.transformer_blocks[1].attn1.to_q.weight.grad is not None


def test_refuses_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"torchao is not installed.*loongforge\[fp8\]"):
        precision.check_fp8_supported(torch.device("cpu"))


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_refuses_gpu_below_sm89(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Test GPU")
    if ok:
        precision.check_fp8_supported(torch.device("cuda", 0))
    else:
        with pytest.raises(ConfigError, match=rf"Test GPU has compute capability {cap[0]}\.{cap[1]}.*>= 8\.9"):
            precision.check_fp8_supported(torch.device("cuda", 0))


def test_memory_config_validation():
    from loongforge.train.config import MemoryConfig

    for bad, field in [({"ac_every": -1}, "ac_every"), ({"fp8_warmup_steps": -2}, "fp8_warmup_steps"),
                       ({"fp8_recipe": "e8m0"}, "fp8_recipe"), ({"fp8_warmup_mode": "x"}, "fp8_warmup_mode"),
                       ({"fp8_min_features": 8}, "fp8_min_features")]:
        with pytest.raises(ConfigError, match=f"memory.{field}"):
            MemoryConfig(**bad)


@pytest.mark.slow
@needs_torchao
def test_fp8_ac_zero3_two_ranks_trains(ac_fp8_zero3_launch):
    """FP8 linears + warm-up + AC under ZeRO-3 on 2 gloo ranks (emulated FP8 GEMMs on CPU): the
    first warm-up step equals the BF16-path loss, later steps run FP8, losses stay finite. One
    launch with test_ac's ZeRO-3 check (tests/train/conftest.py)."""
    proc = ac_fp8_zero3_launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("FP8-ZERO3-OK") == 2, proc.stdout[-3000:]


# -- numerics on a GPU (make gpu-check) ----------------------------------------------------------


@pytest.mark.gpu
@cuda
def test_gpu_fp8_linear_close_to_bf16():
    _require_torchao()
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < precision.FP8_MIN_CAPABILITY:
        with pytest.raises(ConfigError, match="compute capability"):
            precision.check_fp8_supported(dev)
        return
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024)).to(dev, torch.bfloat16)
    ref = copy.deepcopy(seq)
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(seq, module_filter_fn=lambda m, n: n == "1")
    assert isinstance(seq[1], Float8Linear)
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y, r = seq(x), ref(x)
    rel = ((y.float() - r.float()).norm() / r.float().norm()).item()
    assert 0 < rel < 0.08, rel  # e4m3 tensorwise: a few percent
    y.float().square().mean().backward()
    assert torch.isfinite(seq[1].weight.grad).all()


@pytest.mark.gpu
@cuda
def test_gpu_fp8_training_tracks_bf16_after_warmup(train_root):
    _require_torchao()
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < precision.FP8_MIN_CAPABILITY:
        pytest.skip("FP8 needs compute capability >= 8.9")
    from tests.train.gpu_model import model_and_inputs

    base, (batch, noise, t) = model_and_inputs(train_root[0], "small", device=dev, dtype=torch.bfloat16, batch_size=8)
    losses = {}
    for name in ("bf16", "fp8"):
        m = copy.deepcopy(base)
        w = None
        if name == "fp8":
            assert precision.convert_fp8(m, min_features=256, device=dev)
            w = precision.Fp8Warmup(m, steps=5)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out = []
        for step in range(30):
            if w is not None:
                w.on_step(step)
            loss = m(batch, noise, t)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    assert all(map(lambda v: v == v, losses["fp8"]))
    assert abs(losses["fp8"][0] - losses["bf16"][0]) < 1e-2  # step 0 of the warm-up: the BF16 path
    assert losses["fp8"][-1] < losses["fp8"][0] and abs(losses["fp8"][-1] - losses["bf16"][-1]) < 0.15 * losses["bf16"][0]


@needs_torchao
def test_fp8_gemms_get_inner_dims_padded_to_16_for_any_token_count(monkeypatch):
    """161 tokens x micro-batch 8 = 1,288 tokens: the weight-gradient GEMM
    has them as its inner dimension, which cuBLAS needs to be a multiple of 16 (CPU's reference
    _scaled_mm has no such limit, so the shapes handed to it are what is checked)."""
    from torchao.float8 import Float8LinearConfig

    assert precision.fp8_config(Float8LinearConfig, "tensorwise").pad_inner_dim
    assert precision.fp8_config(Float8LinearConfig, "rowwise").pad_inner_dim
    m = _model(depth=3, dim=256)
    names = precision.convert_fp8(m, min_features=256)
    assert names and all(isinstance(m.get_submodule(n), Float8Linear) for n in names)
    assert all(m.get_submodule(n).config.pad_inner_dim for n in names)
    shapes, scaled_mm = [], torch._scaled_mm

    def spy(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    lin = m.get_submodule(names[0])
    x = torch.randn(8, 161, lin.in_features, requires_grad=True)
    lin(x).sum().backward()
    assert len(shapes) == 3  # output, grad input, grad weight
    assert all(a[1] % 16 == 0 and b[0] % 16 == 0 for a, b in shapes), shapes
    assert (lin.out_features, 1296) in [a for a, _ in shapes]  # 1,288 tokens padded with 8 zero rows
    assert lin.weight.grad.shape == lin.weight.shape and x.grad.shape == x.shape


@needs_torchao
def test_warmup_blend_adds_no_graph_per_step_under_fusion():
    """The blend share changes every warm-up step; fused blocks compile with dynamic=False, where a
    Python float read in the graph is a constant (a recompile per step, until dynamo's limit sent
    the blocks to eager). The share is a tensor: 2 graphs in all (high precision only, blended)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lin = nn.Linear(16, 16)
    fp8_like = lin.forward  # any forward stands for Float8Linear's: the blend is what is compiled
    precision._blend_forward(lin)
    f = torch.compile(lambda x: lin(x), backend="aot_eager", dynamic=False)
    x = torch.randn(4, 16)
    for step in range(10):
        precision.set_mix(lin, step / 10)
        torch.testing.assert_close(f(x), fp8_like(x))
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
