"""The attention interface against the dense-mask SDPA reference (train/model/attention.py), and the
transformers blocks routed through it against transformers' own attention."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from loongforge.shared.errors import ConfigError
from loongforge.train.model import attention as attn
from loongforge.train.model.mask import Causal, Keys

CUDA = torch.cuda.is_available()


def left_padded(seed: int, b=4, n=37, device="cpu") -> torch.Tensor:
    """(B, N) validity of left-padded rows: row 0 full, the others shorter."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0] = n
    return (torch.arange(n)[None] >= n - lengths[:, None]).to(device)


def key_mask(seed: int, b=4, n=37, device="cpu") -> torch.Tensor:
    """(B, N) keys a cross-attention sees; the last row sees none (a bad sample: the key-0 fallback)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(b, n, generator=g) < 0.6
    keys[-1] = False
    return keys.to(device)


def qkv(seed, b, h, nq, nk, d, *, hkv=None, dtype=torch.float32, device="cpu", grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, nq, d), (b, hkv or h, nk, d), (b, hkv or h, nk, d)]
    return [torch.randn(*s, generator=g).to(device, dtype).requires_grad_(grad) for s in shapes]


def cases(seed, device="cpu"):
    """(mask, nq, nk) of every kind of attention in the model."""
    return [(Causal(left_padded(seed, device=device)), 37, 37), (Keys(key_mask(seed, device=device)), 17, 37),
            (None, 17, 17)]


def run(kernel, mask, q, k, v):
    out = kernel(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v)) if q.requires_grad else None
    return out, grads


class FakeFlash:
    """CPU stand-in for flash-attn's entry points (per-sequence SDPA loops): it checks our packing
    (gathers, cu_seqlens, scatter back) where the real kernel cannot run."""

    __version__ = "fake"

    @staticmethod
    def flash_attn_func(q, k, v, dropout_p=0.0, causal=False):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal))

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
        outs = []
        for i in range(len(cu_q) - 1):
            qs, ks, vs = (x[c[i]:c[i + 1]].transpose(0, 1) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
            assert qs.shape[1] <= max_q and ks.shape[1] <= max_k
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        return torch.cat(outs)


# ---- CPU ------------------------------------------------------------------------------------------
def test_rules_leave_no_row_without_keys():
    """A left-padded pad query sees itself; a cross row with no key sees key 0: no NaN anywhere."""
    for mask, nq, nk in cases(0)[:2]:
        q, k, v = qkv(0, 4, 2, nq, nk, 8)
        assert torch.isfinite(attn.sdpa_dense(q, k, v, mask)).all()
    valid = left_padded(1)
    dense = attn.masks.dense(Causal(valid), 37)[:, 0]
    for b in range(4):
        real = valid[b].nonzero().flatten()
        sub = dense[b][real][:, real]
        assert torch.equal(sub, torch.tril(torch.ones_like(sub)))  # causal among the real tokens
        assert not dense[b][real][:, ~valid[b]].any()  # a real query never sees a pad


@pytest.mark.parametrize("seed", [0, 1])
def test_flash_packing_matches_sdpa_forward_and_gradients(seed):
    for mask, nq, nk in cases(seed):
        q, k, v = qkv(seed, 4, 2, nq, nk, 16, grad=True)
        want, wgrads = run(attn.sdpa_dense, mask, q, k, v)
        got, grads = run(lambda *a: attn.flash(*a, fa=FakeFlash), mask, q, k, v)
        if isinstance(mask, Causal):  # padded queries: their own v (the rule: themselves alone)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, wgrads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flex_forward_matches_sdpa_on_cpu(seed):
    for mask, nq, nk in cases(seed):
        q, k, v = qkv(seed, 4, 2, nq, nk, 16)
        torch.testing.assert_close(attn.flex(q, k, v, mask, compiled=False), attn.sdpa_dense(q, k, v, mask),
                                   atol=1e-5, rtol=1e-5)


def test_flex_pads_heads_below_16_and_keeps_their_scale():
    for mask, nq, nk in cases(3)[:2]:
        q, k, v = qkv(3, 4, 2, nq, nk, 8)
        got = attn.flex(q, k, v, mask, compiled=False)
        assert got.shape == q.shape
        torch.testing.assert_close(got, attn.sdpa_dense(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_flex_on_cpu_trains_through_sdpa():
    mask = cases(0)[0][0]
    q, k, v = qkv(0, 4, 2, 37, 37, 16, grad=True)
    want, wgrads = run(attn.sdpa_dense, mask, q, k, v)
    got, grads = run(attn.Attention("flex"), mask, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, wgrads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_grouped_kv_heads_are_repeated_per_query_head():
    q, k, v = qkv(4, 2, 8, 9, 9, 8, hkv=4)
    mask = Causal(left_padded(4, b=2, n=9))
    want = attn.sdpa_dense(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)
    torch.testing.assert_close(attn.Attention("sdpa")(q, k, v, mask), want)


def test_qwen3_and_siglip2_blocks_through_the_interface_match_transformers():
    """The same transformers layers, once through our kernel (causal over valid keys), once through
    transformers' own sdpa with its own causal + padding mask: equal on every real token."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
    from transformers.models.siglip2.modeling_siglip2 import Siglip2EncoderLayer

    from loongforge.train.model.backbone import hf_text_config
    from loongforge.train.model.config import TextConfig, VisionConfig
    from loongforge.train.model.vision import hf_vision_config

    torch.manual_seed(0)
    cfg = hf_text_config(TextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, vocab_size=64), 1)
    ours = Qwen3DecoderLayer(cfg, 0).eval()
    attn.bind_attention(ours, attn.Attention("sdpa"))
    ref_cfg = hf_text_config(TextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, vocab_size=64), 1)
    ref_cfg._attn_implementation = "sdpa"
    ref = Qwen3DecoderLayer(ref_cfg, 0).eval()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 11, 32)
    valid = left_padded(5, b=3, n=11)
    pos = torch.arange(11)[None].expand(3, 11)
    rope = Qwen3RotaryEmbedding(cfg)(x, pos)
    hf_mask = create_causal_mask(config=ref_cfg, inputs_embeds=x, attention_mask=valid.long(), past_key_values=None,
                                 position_ids=pos)
    got = ours(x, attention_mask=Causal(valid), position_embeddings=rope)
    want = ref(x, attention_mask=hf_mask, position_embeddings=rope)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)

    vcfg = hf_vision_config(VisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                         num_patches=16))
    vis = Siglip2EncoderLayer(vcfg).eval()
    attn.bind_attention(vis, attn.Attention("sdpa"))
    vref_cfg = hf_vision_config(VisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                             num_patches=16))
    vref_cfg._attn_implementation = "sdpa"
    vref = Siglip2EncoderLayer(vref_cfg).eval()
    vref.load_state_dict(vis.state_dict())
    y = torch.randn(2, 16, 32)
    torch.testing.assert_close(vis(y, attention_mask=None), vref(y, attention_mask=None), atol=1e-5, rtol=1e-5)


def test_unbound_site_says_how_to_build_it():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from loongforge.train.model.backbone import hf_text_config
    from loongforge.train.model.config import TextConfig

    layer = Qwen3DecoderLayer(hf_text_config(TextConfig(hidden_size=16, intermediate_size=16,
                                                        num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                                        vocab_size=8), 1), 0)
    rope = (torch.ones(1, 3, 8), torch.zeros(1, 3, 8))
    with pytest.raises(RuntimeError, match="build_model"):
        layer(torch.randn(1, 3, 16), attention_mask=None, position_embeddings=rope)


def test_choice_and_its_reason_on_cpu(caplog, monkeypatch):
    cpu = torch.device("cpu")
    for requested, reason in (("auto", "auto on CPU"), ("flash", "flash on CPU"), ("sdpa", "reference")):
        kernel, line = attn.choose(requested, cpu, torch.float32, 16)
        assert kernel is attn.sdpa_dense and reason in line, line
    _, line = attn.choose("flex", cpu, torch.float32, 16)
    assert "forward only" in line
    monkeypatch.setattr(attn, "_SAID", set())  # as in a fresh process
    a, b = attn.Attention("auto"), attn.Attention("auto")  # as the LLM's and the DiT's: one line for both
    q, k, v = qkv(0, 1, 1, 4, 4, 8)
    with caplog.at_level(logging.INFO, logger="loongforge.train.model.attention"):
        a(q, k, v, None)
        a(q, k, v, Causal(torch.ones(1, 4, dtype=torch.bool)))
        b(q, k, v, None)
    assert [r.getMessage() for r in caplog.records] == ["attention (auto): " + a.chosen[(cpu, torch.float32, 8)]]
    with pytest.raises(ConfigError, match="model.attention"):
        attn.Attention("cudnn")


def test_flash_fallback_reasons(monkeypatch):
    """Which GPU/dtype/head size flash refuses, and what auto then runs (flash-attn faked)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "GPU")
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.x"))
    for cap, dtype, hd, reason in (((7, 5), torch.bfloat16, 64, "sm_75 < 8.0"),
                                   ((9, 0), torch.float32, 64, "needs fp16/bf16"),
                                   ((9, 0), torch.bfloat16, 512, "head_dim 512")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        fa, why = attn.flash_unusable(cuda, dtype, hd)
        assert fa is None and reason in why
        _, line = attn.choose("auto", cuda, dtype, hd)
        assert line.startswith("flex") and reason in line and "compiled" in line
    fa, why = attn.flash_unusable(cuda, torch.bfloat16, 64)
    assert why is None
    assert attn.choose("flash", cuda, torch.bfloat16, 64)[1].startswith("flash-attn 2.x")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert "not importable" in attn.flash_unusable(cuda, torch.bfloat16, 64)[1]


def test_cli_flag_reaches_the_model_options():
    import argparse

    from loongforge.train.flags import add_train_args, config_from_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    assert config_from_args(p.parse_args(["--data", "d", "--run-dir", "r", "--attention", "flex"])).model.attention \
        == "flex"


# ---- GPU (make gpu-check) -------------------------------------------------------------------------
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _flash_usable() -> bool:
    return CUDA and attn.flash_unusable(torch.device("cuda", 0), torch.bfloat16, 64)[0] is not None


def _check_on_cuda(kernel, dtype, seed=0):
    """kernel vs the fp32 dense reference on the same (rounded) inputs, forward and gradients."""
    for mask, nq, nk in cases(seed, device="cuda"):
        q, k, v = qkv(seed, 4, 2, nq, nk, 64, dtype=dtype, device="cuda", grad=True)
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        want, wgrads = run(attn.sdpa_dense, mask, *ref)
        got, grads = run(kernel, mask, q, k, v)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        for g, w in zip(grads, wgrads):
            torch.testing.assert_close(g.float(), w, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_compiled_matches_sdpa_on_cuda(dtype):
    _check_on_cuda(lambda q, k, v, m: attn.flex(q, k, v, m, compiled=True), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_usable(), reason="needs CUDA sm >= 8.0 and flash-attn")
def test_flash_matches_sdpa_on_cuda():
    import flash_attn

    _check_on_cuda(lambda q, k, v, m: attn.flash(q, k, v, m, fa=flash_attn), torch.bfloat16)
