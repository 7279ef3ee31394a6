"""Attention backends against the dense-mask SDPA reference (train/model/attention.py)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from loongforge.shared.errors import ConfigError
from loongforge.train.model import attention as attn
from loongforge.train.model import mask as masks
from loongforge.train.model.mask import Causal, VLCross, VLLayout, VLSelf, vl_segments, vl_valid_lengths

CUDA = torch.cuda.is_available()


def random_layout(seed: int, *, b=4, cameras=2, frames=4, tokens=36, text=20, device="cpu") -> VLLayout:
    """Random valid prefixes per sample; sample 0 fully valid (full flex blocks), the last one
    with no valid token at all (the fallback rows)."""
    g = torch.Generator().manual_seed(seed)
    nf = torch.randint(0, frames + 1, (b,), generator=g)
    nt = torch.randint(0, text + 1, (b,), generator=g)
    nf[0], nt[0], nf[-1], nt[-1] = frames, text, 0, 0
    frame_mask = torch.arange(frames)[None] < nf[:, None]
    task_mask = torch.arange(text)[None] < nt[:, None]
    segs = vl_segments(cameras=cameras, frames=frames, tokens_per_frame=tokens, text_len=text)
    lengths = vl_valid_lengths(frame_mask, task_mask, cameras=cameras, tokens_per_frame=tokens)
    return VLLayout(segs, lengths.to(device))


def qkv(seed, b, h, nq, nk, d, *, dtype=torch.float32, device="cpu", grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, h, n, d, generator=g).to(device, dtype) for n in (nq, nk, nk)]
    return [t.requires_grad_(grad) for t in out]


def cases(layout: VLLayout, h=2, d=16):
    """(mask, nq, nk) for every kind of attention in the model."""
    n, b = layout.n, layout.lengths.shape[0]
    return [(VLSelf(layout), n, n), (VLCross(layout), 17, n), (Causal(16), 16, 16), (None, 17, 17)]


def run(kernel, mask, q, k, v):
    out = kernel(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v)) if q.requires_grad else None
    return out, grads


class FakeFlash:
    """CPU stand-in for flash-attn's two entry points (per-sequence SDPA loops): it checks our
    packing (gathers, cu_seqlens, scatter back) where the real kernel cannot run."""

    __version__ = "fake"

    @staticmethod
    def flash_attn_func(q, k, v, dropout_p=0.0, causal=False):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal))

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
        outs = []
        for i in range(len(cu_q) - 1):
            qs, ks, vs = (x[c[i]:c[i + 1]].transpose(0, 1) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
            assert qs.shape[1] <= max_q and ks.shape[1] <= max_k
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        return torch.cat(outs)


# ---- CPU ------------------------------------------------------------------------------------------
def test_torch_has_no_flex_backward_on_cpu():
    """The fact the flex backend is built around (torch 2.13): forward yes, backward no."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv(0, 1, 1, 8, 8, 16, grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, k, v)
    with torch.no_grad(), pytest.raises(NotImplementedError):
        flex_attention(q, k, v)  # even without grad mode
    assert torch.isfinite(flex_attention(q.detach(), k.detach(), v.detach())).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flex_forward_matches_sdpa_on_cpu(seed):
    layout = random_layout(seed)
    for mask, nq, nk in cases(layout):
        q, k, v = qkv(seed, 4, 2, nq, nk, 16)
        want = attn.sdpa_dense(q, k, v, mask)
        got = attn.flex(q, k, v, mask, compiled=False)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _block_sets(num, idx, nk):
    """(B, 1, nq) counts + (B, 1, nq, nk) indices -> (B, nq, nk) bool."""
    out = torch.zeros(*num.shape[::2], nk, dtype=torch.bool)
    for b in range(num.shape[0]):
        for i in range(num.shape[2]):
            out[b, i, idx[b, 0, i, : num[b, 0, i]].long()] = True
    return out


@pytest.mark.parametrize("seed", [0, 3])
def test_flex_block_table_equals_the_predicate_evaluated_densely(seed):
    """Our O(blocks) table = create_block_mask, which evaluates the rule on every (q, kv) pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    layout = random_layout(seed, frames=3, tokens=64)  # N = 2*192 + 3 + 20: full, partial, empty, ragged
    for mask, nq in ((VLSelf(layout), layout.n), (VLCross(layout), 300)):
        ours = attn.flex_block_mask(mask, nq)
        rule = masks.rule(mask)
        ref = create_block_mask(lambda b, h, q, kv: rule(b, q, kv), 4, None, nq, layout.n, device="cpu")
        nk = ref.kv_indices.shape[-1]
        for a, r in (((ours.kv_num_blocks, ours.kv_indices), (ref.kv_num_blocks, ref.kv_indices)),
                     ((ours.full_kv_num_blocks, ours.full_kv_indices), (ref.full_kv_num_blocks, ref.full_kv_indices))):
            assert torch.equal(_block_sets(*a, nk), _block_sets(*r, nk))
        assert ours.full_kv_num_blocks.sum() > 0 and ours.kv_num_blocks.sum() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_flash_packing_matches_sdpa_forward_and_gradients(seed):
    layout = random_layout(seed)
    for mask, nq, nk in cases(layout):
        q, k, v = qkv(seed, 4, 2, nq, nk, 16, grad=True)
        want, wgrads = run(attn.sdpa_dense, mask, q, k, v)
        got, grads = run(lambda *a: attn.flash(*a, fa=FakeFlash), mask, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, wgrads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_structured_sdpa_matches_dense_forward_and_gradients():
    for mask, n in ((Causal(16), 16), (None, 17)):
        q, k, v = qkv(5, 3, 2, n, n, 16, grad=True)
        want, wgrads = run(attn.sdpa_dense, mask, q, k, v)
        got, grads = run(attn.sdpa_structured, mask, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, wgrads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_flex_on_cpu_trains_through_sdpa():
    layout = random_layout(0)
    q, k, v = qkv(0, 4, 2, layout.n, layout.n, 16, grad=True)
    want, wgrads = run(attn.sdpa_dense, VLSelf(layout), q, k, v)
    got, grads = run(attn.Attention("flex"), VLSelf(layout), q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, wgrads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _no_dense(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("dense mask built")

    for name in ("vl_self_mask", "cross_mask", "causal_mask"):
        monkeypatch.setattr(masks, name, refuse)


def test_model_flex_forward_matches_sdpa_and_builds_no_dense_mask(monkeypatch, train_root):
    from tests.train.model.test_model import _batch

    from loongforge.train.model import recipes
    from loongforge.train.model.model import VLAModel

    root, index = train_root
    batch = _batch(root, index)
    torch.manual_seed(0)
    ref = VLAModel(recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2, attention="sdpa"))
    model = VLAModel(dataclasses.replace(ref.cfg, attention="flex"))
    model.load_state_dict(ref.state_dict())
    noise, u = torch.randn(4, ref.cfg.action_horizon, ref.cfg.action_dim), torch.rand(4)
    with torch.no_grad():
        want = ref(batch, noise, u)["loss"]
        _no_dense(monkeypatch)
        got = model(batch, noise, u)["loss"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert "flex" in next(iter(model.blocks[0].attn.chosen.values()))


def test_choice_and_its_reason_on_cpu(caplog):
    cpu = torch.device("cpu")
    for requested, reason in (("auto", "auto on CPU"), ("flash", "needs CUDA"), ("sdpa", "reference")):
        kernel, line = attn.choose(requested, cpu, torch.float32, 16)
        assert kernel is attn.sdpa_dense and reason in line
    kernel, line = attn.choose("flex", cpu, torch.float32, 16)
    assert "forward only" in line
    a = attn.Attention("auto")
    q, k, v = qkv(0, 1, 1, 4, 4, 8)
    with caplog.at_level(logging.INFO, logger="loongforge.train.model.attention"):
        a(q, k, v, None)
        a(q, k, v, Causal(4))
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
    assert attn.choose("flash", cuda, torch.bfloat16, 64)[1].startswith("flash-attn 2.x varlen")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert "not importable" in attn.flash_unusable(cuda, torch.bfloat16, 64)[1]


# ---- GPU (make gpu-check) -------------------------------------------------------------------------
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _flash_usable() -> bool:
    return CUDA and attn.flash_unusable(torch.device("cuda", 0), torch.bfloat16, 64)[0] is not None


def _check_on_cuda(kernel, dtype, seed=0):
    """kernel vs the fp32 dense reference on the same (rounded) inputs, forward and gradients."""
    layout = random_layout(seed, device="cuda")
    for mask, nq, nk in cases(layout):
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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_auto_on_cuda_builds_no_dense_mask_and_matches_sdpa(monkeypatch, train_root):
    from tests.train.model.test_model import _batch

    from loongforge.train.model import recipes
    from loongforge.train.model.model import VLAModel

    root, index = train_root
    batch = {k: ({s: f.cuda() for s, f in v.items()} if isinstance(v, dict) else v.cuda())
             for k, v in _batch(root, index).items()}
    torch.manual_seed(0)
    ref = VLAModel(recipes.resolve("small", index, max_text_tokens=32, max_frames=2, attention="sdpa"))
    model = VLAModel(dataclasses.replace(ref.cfg, attention="auto"))
    model.load_state_dict(ref.state_dict())
    ref, model = ref.cuda().to(torch.bfloat16), model.cuda().to(torch.bfloat16)
    noise = torch.randn(4, ref.cfg.action_horizon, ref.cfg.action_dim, device="cuda")
    u = torch.rand(4, device="cuda")
    want = ref(batch, noise, u)["loss"]
    _no_dense(monkeypatch)
    got = model(batch, noise, u)["loss"]
    got.backward()
    line = next(iter(model.blocks[0].attn.chosen.values()))
    assert line.startswith("flash-attn" if _flash_usable() else "flex"), line
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_cli_flag_reaches_the_model_config():
    import argparse

    from loongforge.train.flags import add_train_args, config_from_args
    from loongforge.train.model.build import model_overrides

    p = argparse.ArgumentParser()
    add_train_args(p)
    cfg = config_from_args(p.parse_args(["--data", "d", "--run-dir", "r", "--attention", "flex"]))
    assert model_overrides(cfg) == {"attention": "flex"}
    assert model_overrides(config_from_args(p.parse_args(["--data", "d", "--run-dir", "r"]))) == {}


def test_flex_pads_heads_below_16_and_keeps_their_scale(monkeypatch):
    """Compiled FlexAttention on CUDA raises NotImplementedError for head_dim < 16 (tiny: 12): the
    kernel gets 16 columns, zero-padded, with the scale of 12, and the result equals SDPA's."""
    from torch.nn.attention import flex_attention as fa_mod

    seen, real = [], fa_mod.flex_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], kw.get("scale")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fa_mod, "flex_attention", spy)
    layout = random_layout(3)
    for mask, nq, nk in cases(layout)[:2]:  # the two kinds flex runs (vl self, vl cross)
        q, k, v = qkv(3, 4, 2, nq, nk, 12)
        got = attn.flex(q, k, v, mask, compiled=False)
        assert got.shape == q.shape[:-1] + (12,)
        torch.testing.assert_close(got, attn.sdpa_dense(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert seen == [(16, 16, 16, pytest.approx(12 ** -0.5))] * 2


def test_flex_block_mask_is_built_once_outside_compiled_blocks(monkeypatch):
    """Under fusion the BlockMask is built eagerly (never inside a compiled graph, whose CUDA-graph
    pool would be overwritten by the next replay) and once per layout for all calls. The pool
    itself exists only under CUDA graphs; on CPU this checks the build count, the cache and the
    result through a graph break (aot_eager, forward only: CPU flex has no backward)."""
    from torch._dynamo.utils import counters

    built, table = [], attn._kv_table
    monkeypatch.setattr(attn, "_kv_table", lambda blocks: built.append(1) or table(blocks))
    torch._dynamo.reset()
    counters.clear()
    layout = random_layout(4)
    mask = VLSelf(layout)
    q, k, v = qkv(4, 4, 2, layout.n, layout.n, 16)
    f = torch.compile(lambda q, k, v: attn.flex(q, k, v, mask, compiled=False) * 2, backend="aot_eager")
    with torch.no_grad():
        outs = [f(q, k, v) for _ in range(3)]
    want = attn.sdpa_dense(q, k, v, mask) * 2
    for out in outs:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert len(built) == 2  # partial and full block tables, once
    assert any("disable" in reason.lower() for reason in counters["graph_break"]), dict(counters["graph_break"])
    torch._dynamo.reset()
