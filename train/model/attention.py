"""The one attention interface: `Attention(requested)(q, k, v, mask, dropout_p)`.

q, k, v are (B, heads, N, head_dim) (k and v may have fewer heads: grouped KV heads are
repeated here); `mask` is a description from mask.py (`Causal`, `Keys`) or None, never a tensor.
Every attention of the model goes through it: the DiT's own attention module calls it, and the
transformers blocks of the backbone (Qwen3, SigLIP2) reach it through the attention function
registered under `HF_ATTENTION`, which looks up the `Attention` bound to the module
(`bind_attention`). A parallel plan (Ulysses sequence parallelism) swaps a site's bound callable
from outside; the model never knows.

Which kernel runs is decided on the first call for a (device, dtype, head_dim) and said once:

  sdpa   reference: the dense boolean masks of mask.dense (the CPU default).
  flex   FlexAttention with a BlockMask from mask.rule (create_block_mask; the sequences of N1.6
         are a few hundred tokens); compiled on CUDA, head_dim zero-padded to 16 below it. On CPU
         (torch 2.13) only its forward exists: calls that need gradients run sdpa.
  flash  flash-attn: Causal as varlen over each row's valid suffix with its causal kernel (padded
         queries get v: attention to themselves alone, as the rule); Keys as varlen keys; no mask
         as its dense kernel. Needs CUDA, sm >= 8.0, fp16/bf16, head_dim <= 256.
  auto   CUDA: flash if usable, else flex; CPU: sdpa.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.model import mask as masks
from loongforge.train.model.hf import AttentionInterface
from loongforge.train.model.mask import Causal

log = logging.getLogger(__name__)
_SAID: set[tuple[str, str]] = set()  # (requested, choice) lines this process logged at INFO

BACKENDS = ("auto", "sdpa", "flex", "flash")
HF_ATTENTION = "loongforge"  # transformers' attn_implementation name of this interface
KERNEL_ATTR = "attention_kernel"  # the callable an attention site calls; bound per module


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, h_kv, N, d) -> (B, h_kv * groups, N, d), each KV head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def sdpa_dense(q, k, v, mask, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense(mask, q.shape[2]), dropout_p=dropout_p)


# ---- flex -----------------------------------------------------------------------------------------
FLEX_MIN_HEAD_DIM = 16  # inductor's CUDA FlexAttention kernel (tl.dot) needs head_dim >= 16
_compiled_flex = None


# NOTE: built outside torch.compile, once per batch and kind (cached on the description): traced
# inside a fused block under --cuda-graphs its tensors would live in the graph's private pool.
@torch.compiler.disable
def flex_block_mask(mask, nq: int, nk: int, device):
    from torch.nn.attention.flex_attention import create_block_mask  # loads torch's compile stack

    r = masks.rule(mask)
    b = mask.valid.shape[0] if isinstance(mask, Causal) else mask.keys.shape[0]
    return mask.cached(("flex", nq, nk), lambda: create_block_mask(lambda bb, h, q, kv: r(bb, q, kv), b, None, nq, nk,
                                                                   device=device))


def _flex_fn(compiled: bool):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention  # as in flex_block_mask

    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex(q, k, v, mask, dropout_p=0.0, *, compiled: bool):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        if torch.is_grad_enabled():
            return sdpa_dense(q, k, v, mask, dropout_p)  # no FlexAttention backward on CPU (torch 2.13)
        q, k, v = q.detach(), k.detach(), v.detach()
    if dropout_p > 0:
        raise ConfigError("attention: FlexAttention has no attention dropout; use --attention flash or sdpa")
    fn, bm, d = _flex_fn(compiled), flex_block_mask(mask, q.shape[2], k.shape[2], q.device), q.shape[-1]
    if d >= FLEX_MIN_HEAD_DIM:
        return fn(q, k, v, block_mask=bm)
    pad = (0, FLEX_MIN_HEAD_DIM - d)  # zero columns change neither q.k nor the kept outputs
    return fn(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), block_mask=bm, scale=d ** -0.5)[..., :d]


# ---- flash ----------------------------------------------------------------------------------------
def _varlen(keep: torch.Tensor):
    """(B, N) bool -> (flat indices of the kept tokens, cu_seqlens int32 (B+1,), max length)."""
    counts = keep.sum(1, dtype=torch.int32)
    cu = F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    # NOTE: nonzero() and .item() sync with the host: once per batch and kind (cached on the
    # description), not once per layer.
    return keep.flatten().nonzero().squeeze(1), cu, int(counts.max().item())


def _tokens(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)


# NOTE: kept out of torch.compile: the packed token count and max_seqlen (a host .item()) change
# with every batch, which would recompile the fused block around it each batch.
@torch.compiler.disable
def flash(q, k, v, mask, dropout_p=0.0, *, fa):
    b, h, nq, d = q.shape
    if mask is None:
        return fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p).transpose(1, 2)
    if isinstance(mask, Causal):
        idx, cu, mx = mask.cached("flash", lambda: _varlen(mask.valid))
        qf, kf, vf = _tokens(q), _tokens(k), _tokens(v)
        y = fa.flash_attn_varlen_func(qf[idx], kf[idx], vf[idx], cu, cu, mx, mx, dropout_p, causal=True)
        return vf.index_copy(0, idx, y).view(b, nq, h, d).transpose(1, 2)
    idx, cu_k, mx = mask.cached("flash", lambda: _varlen(mask.safe()))
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * nq
    kf, vf = _tokens(k), _tokens(v)
    y = fa.flash_attn_varlen_func(_tokens(q), kf[idx], vf[idx], cu_q, cu_k, nq, mx, dropout_p)
    return y.view(b, nq, h, d).transpose(1, 2)


def flash_unusable(device: torch.device, dtype: torch.dtype, head_dim: int):
    """(flash_attn module, None) or (None, the reason it cannot run here)."""
    if device.type != "cuda":
        return None, "flash-attn needs CUDA"
    try:
        import flash_attn  # optional extra loongforge[gpu], CUDA only
    except ImportError as exc:
        return None, f"flash-attn is not importable ({exc}); install the [gpu] extra"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return None, f"GPU capability sm_{cap[0]}{cap[1]} < 8.0 (flash-attn 2 needs Ampere or newer)"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"flash-attn needs fp16/bf16, the model runs in {str(dtype).removeprefix('torch.')}"
    if head_dim > 256:
        return None, f"head_dim {head_dim} > 256"
    return flash_attn, None


# ---- choice ---------------------------------------------------------------------------------------
def choose(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int):
    """-> (kernel(q, k, v, mask, dropout_p), one line: what runs and why)."""
    if requested == "sdpa":
        return sdpa_dense, "sdpa with dense boolean masks (requested; the reference)"
    cuda = device.type == "cuda"
    why = ""
    if requested in ("auto", "flash"):
        fa, why = flash_unusable(device, dtype, head_dim)
        if fa is not None:
            return (lambda q, k, v, m, p=0.0: flash(q, k, v, m, p, fa=fa),  # noqa: E731
                    f"flash-attn {fa.__version__}: varlen causal for the LLM, varlen keys for the DiT's "
                    f"cross-attention, dense for vision and DiT self ({requested}: {_gpu(device)}, {dtype})")
        if not cuda:
            return sdpa_dense, (f"sdpa with dense boolean masks ({requested} on CPU: the CPU kernel with a "
                                "backward for these masks)")
        why = f"flash unusable: {why}; "
    kernel = lambda q, k, v, m, p=0.0: flex(q, k, v, m, p, compiled=cuda)  # noqa: E731
    where = ("compiled, " + _gpu(device)) if cuda else "eager on CPU: forward only, calls needing gradients run sdpa"
    return kernel, f"flex with BlockMasks from the mask rules ({why}{where})"


def _gpu(device: torch.device) -> str:
    cap = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{cap[0]}{cap[1]}"


class Attention:
    """The attention interface every site calls. Chooses its kernel on the first call for each
    (device, dtype, head_dim) and logs the choice once (rank 0)."""

    def __init__(self, requested: str):
        if requested not in BACKENDS:
            raise ConfigError(f"model.attention={requested!r}: use one of {BACKENDS}")
        self.requested = requested
        self._kernels: dict = {}
        self.chosen: dict = {}  # (device, dtype, head_dim) -> the logged line, for tests and reports

    def __call__(self, q, k, v, mask, dropout_p: float = 0.0):
        if k.shape[1] != q.shape[1]:  # grouped KV heads (Qwen3)
            groups = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        key = (q.device, q.dtype, q.shape[-1])
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel, line = choose(self.requested, q.device, q.dtype, q.shape[-1])
            self._kernels[key], self.chosen[key] = kernel, line
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                said = (self.requested, line) in _SAID  # the LLM's and the DiT's modules choose alike: one line
                _SAID.add((self.requested, line))
                log.log(logging.DEBUG if said else logging.INFO, "attention (%s): %s", self.requested, line)
        return kernel(q, k, v, mask, dropout_p)

    def __getstate__(self):  # kernels hold modules and compiled callables: rebuilt on first use
        return {"requested": self.requested}

    def __setstate__(self, state):
        self.__init__(state["requested"])


def _hf_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **_):
    """transformers' attention-function signature -> the site's bound kernel. Returns (B, N, h, d)."""
    kernel = module.__dict__.get(KERNEL_ATTR)
    if kernel is None:
        raise RuntimeError(f"{type(module).__name__}: no attention kernel bound (build the model with build_model)")
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise RuntimeError(f"{type(module).__name__}: attention scale {scaling} is not 1/sqrt(head_dim)")
    return kernel(query, key, value, attention_mask, dropout).transpose(1, 2).contiguous(), None


AttentionInterface.register(HF_ATTENTION, _hf_attention)


def attention_sites(root: nn.Module) -> list[nn.Module]:
    """Every module of `root` that calls an attention kernel (the transformers blocks' attention
    modules, the DiT's): the ones `bind_attention` binds and a sequence-parallel plan rebinds."""
    return [m for m in root.modules() if getattr(m, "is_attention_site", False)
            or (hasattr(m, "q_proj") and getattr(getattr(m, "config", None), "_attn_implementation", None)
                == HF_ATTENTION)]


def bind_attention(root: nn.Module, attn) -> None:
    """Bind `attn` to every attention site under `root` (a plain attribute: no parameter, no state)."""
    for m in attention_sites(root):
        m.__dict__[KERNEL_ATTR] = attn
