"""Attention backends for the multimodal mask: `Attention(requested)(q, k, v, mask, dropout_p)`.

q, k, v are (B, heads, N, head_dim); `mask` is a description from mask.py, never a tensor:
VLSelf / VLCross (full attention over the valid vl keys), Causal, or None (no mask). Which
kernel runs is decided on the first call (device, dtype and head size are known only then) and
said in one log line:

  sdpa   reference: the dense boolean masks of mask.dense (kept for tests; the CPU default).
  flex   FlexAttention with a BlockMask built from the (B, N) key validity in O(B N / 128 +
         (N / 128)^2) block bookkeeping, mask_mod = mask.rule; torch.compile'd on CUDA, head_dim
         zero-padded to 16 below it (the compiled kernel's minimum). On CPU
         (torch 2.13) only the eager forward exists: a call whose inputs need gradients raises
         NotImplementedError there (eager and compiled alike), so such calls use sdpa.
  flash  flash-attn varlen kernels: the valid tokens are gathered per sample (they are a
         prefix of each segment, so the packed sequence is one index gather), cu_seqlens from
         the counts, scattered back after. Padded vl queries get v (attention to themselves
         alone, as the reference). Needs CUDA, sm >= 8.0, fp16/bf16, head_dim <= 256.
  auto   CUDA: flash if usable, else flex (never a dense N x N mask on the GPU); CPU: sdpa.

Causal and None are never masks outside `sdpa`: SDPA with is_causal / no mask (flash-attn's
own causal kernel under `flash`), which lets SDPA pick its flash or cuDNN kernel on CUDA.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from loongforge.shared.errors import ConfigError
from loongforge.train.model import mask as masks
from loongforge.train.model.mask import Causal, VLSelf

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flex", "flash")
BLOCK = 128  # FlexAttention's default block size; the block table below is built for it


def sdpa_dense(q, k, v, mask, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense(mask, q.device), dropout_p=dropout_p)


def sdpa_structured(q, k, v, mask, dropout_p=0.0):
    """None / Causal without a mask tensor."""
    assert mask is None or isinstance(mask, Causal), mask
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=mask is not None)


# ---- flex -----------------------------------------------------------------------------------------
def _block_counts(keys: torch.Tensor) -> torch.Tensor:
    """(B, N) bool -> (B, ceil(N / BLOCK)) valid tokens per block."""
    b, n = keys.shape
    nb = -(-n // BLOCK)
    return F.pad(keys, (0, nb * BLOCK - n)).view(b, nb, BLOCK).sum(-1)


def _kv_table(blocks: torch.Tensor):
    """(B, nq, nk) bool -> (B, 1, nq) counts, (B, 1, nq, nk) indices with the chosen blocks first."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~blocks).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


# NOTE: built outside torch.compile, once per batch and kind, then cached on the layout for every
# block. Traced inside a fused block under --cuda-graphs (reduce-overhead), its tensors would live
# in the CUDA graph's private pool, which the next replay overwrites while the layout still holds
# them for the following blocks.
@torch.compiler.disable
def flex_block_mask(mask, nq: int):
    """The BlockMask of VLSelf / VLCross without evaluating the predicate on N x N: a block is
    full when all its queries and keys are valid, partial when it holds any allowed pair."""
    # flex_attention loads torch's compile stack; only the flex backend pays for it
    from torch.nn.attention.flex_attention import BlockMask

    layout = mask.layout

    def build():
        keys = layout.valid() if isinstance(mask, VLSelf) else layout.cross_keys()
        kc = _block_counts(keys)
        full_k = kc == BLOCK  # a short last block is never full: its tail is out of range
        if isinstance(mask, VLSelf):
            nb = kc.shape[1]
            eye = torch.eye(nb, dtype=torch.bool, device=keys.device)  # padded queries see themselves
            any_ = ((kc[:, :, None] > 0) & (kc[:, None, :] > 0)) | eye
            full = full_k[:, :, None] & full_k[:, None, :]
        else:
            nqb = -(-nq // BLOCK)
            q_whole = torch.arange(1, nqb + 1, device=keys.device) * BLOCK <= nq  # as create_block_mask
            any_ = (kc > 0)[:, None, :].expand(-1, nqb, -1)
            full = full_k[:, None, :] & q_whole[None, :, None]
        rule = masks.rule(mask)
        return BlockMask.from_kv_blocks(*_kv_table(any_ & ~full), *_kv_table(full), BLOCK_SIZE=BLOCK,
                                        mask_mod=lambda b, h, q, kv: rule(b, q, kv), seq_lengths=(nq, layout.n))

    return layout.cached(("flex", type(mask).__name__, nq), build)


_compiled_flex = None
# Inductor's CUDA FlexAttention kernel (tl.dot) needs head_dim >= 16, and raises NotImplementedError
# below it (torch 2.13, _inductor/kernel/flex/flex_attention.py); `tiny` heads have 12. Smaller
# heads are zero-padded to 16 (non-powers of 2 above it the kernel rounds up itself).
FLEX_MIN_HEAD_DIM = 16


def _flex_fn(compiled: bool):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention  # as in flex_block_mask

    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        # NOTE: one compiled callable for all shapes: frame buckets are a small fixed set, and
        # after the first recompile dynamo marks the lengths dynamic instead of recompiling each.
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex(q, k, v, mask, dropout_p=0.0, *, compiled: bool):
    if mask is None or isinstance(mask, Causal):
        return sdpa_structured(q, k, v, mask, dropout_p)
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        # torch 2.13 refuses any CPU input that requires grad, even under no_grad.
        if torch.is_grad_enabled():
            return sdpa_dense(q, k, v, mask, dropout_p)  # no FlexAttention backward on CPU
        q, k, v = q.detach(), k.detach(), v.detach()
    if dropout_p > 0:
        raise ConfigError("model.dropout: FlexAttention has no attention dropout; use --attention flash or "
                          "sdpa, or model.dropout=0")
    fn, block_mask, d = _flex_fn(compiled), flex_block_mask(mask, q.shape[2]), q.shape[-1]
    if d >= FLEX_MIN_HEAD_DIM:
        return fn(q, k, v, block_mask=block_mask)
    # Zero columns leave q.k (and so the softmax, with the scale kept at 1/sqrt(d)) unchanged and
    # add zero output columns, cut off after; autograd passes through the pad and the slice.
    pad = (0, FLEX_MIN_HEAD_DIM - d)
    y = fn(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), block_mask=block_mask, scale=d ** -0.5)
    return y[..., :d]


# ---- flash ----------------------------------------------------------------------------------------
def _varlen(keys: torch.Tensor):
    """(B, N) bool -> (flat indices of the kept tokens, cu_seqlens int32 (B+1,), max length)."""
    counts = keys.sum(1, dtype=torch.int32)
    cu = F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    # NOTE: nonzero() and .item() sync with the host: once per batch and kind (cached on the
    # layout), not once per layer.
    return keys.flatten().nonzero().squeeze(1), cu, int(counts.max().item())


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, h, N, d) -> (B*N, h, d); a view when x came from split_heads."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)


# NOTE: kept out of torch.compile (fusion compiles each block's forward): the packed token total
# and max_seqlen (a host .item()) change with every batch, so a traced flash would recompile the
# block each batch, shared by all blocks, until dynamo's recompile limit dropped them to eager. As
# one opaque call the block graphs around it see only the padded (B, h, N, d) shapes.
@torch.compiler.disable
def flash(q, k, v, mask, dropout_p=0.0, *, fa):
    b, h, nq, d = q.shape
    if mask is None or isinstance(mask, Causal):
        y = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                               causal=mask is not None)
        return y.transpose(1, 2)
    layout = mask.layout
    if isinstance(mask, VLSelf):
        idx, cu, mx = layout.cached("flash_self", lambda: _varlen(layout.valid()))
        qf, kf, vf = _tokens(q), _tokens(k), _tokens(v)
        y = fa.flash_attn_varlen_func(qf[idx], kf[idx], vf[idx], cu, cu, mx, mx, dropout_p)
        out = vf.index_copy(0, idx, y)  # padded queries: v, i.e. attention to themselves alone
        return out.view(b, nq, h, d).transpose(1, 2)
    idx, cu_k, mx = layout.cached("flash_cross", lambda: _varlen(layout.cross_keys()))
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
            kernel = lambda q, k, v, m, p=0.0: flash(q, k, v, m, p, fa=fa)  # noqa: E731
            return kernel, (f"flash-attn {fa.__version__} varlen for vl self/cross, its causal kernel for bins "
                            f"self, no mask for act self ({requested}: {_gpu(device)}, {dtype})")
        if not cuda and requested == "auto":
            return sdpa_dense, ("sdpa with dense boolean masks (auto on CPU: the only CPU kernel with a backward "
                                "for this mask; causal/none as masks too)")
        why = f"flash unusable: {why}; "
    if not cuda and requested == "flash":
        return sdpa_dense, f"sdpa with dense boolean masks ({why}the CPU fallback that trains)"
    kernel = lambda q, k, v, m, p=0.0: flex(q, k, v, m, p, compiled=cuda)  # noqa: E731
    where = ("compiled, " + _gpu(device)) if cuda else (
        "eager on CPU: forward only in torch 2.13, calls needing gradients run sdpa with dense masks")
    return kernel, (f"flex with a BlockMask from the valid lengths for vl self/cross, SDPA is_causal for bins "
                    f"self, no mask for act self ({why}{where})")


def _gpu(device: torch.device) -> str:
    cap = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{cap[0]}{cap[1]}"


class Attention:
    """The one attention interface every block calls. Chooses its kernel on the first call for
    each (device, dtype, head_dim) and logs that choice once (rank 0)."""

    def __init__(self, requested: str):
        if requested not in BACKENDS:
            raise ConfigError(f"model.attention={requested!r}: use one of {BACKENDS}")
        self.requested = requested
        self._kernels: dict = {}
        self.chosen: dict = {}  # (device, dtype, head_dim) -> the logged line, for tests and reports

    def __call__(self, q, k, v, mask, dropout_p: float = 0.0):
        key = (q.device, q.dtype, q.shape[-1])
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel, line = choose(self.requested, q.device, q.dtype, q.shape[-1])
            self._kernels[key], self.chosen[key] = kernel, line
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                log.info("attention (%s): %s", self.requested, line)
        return kernel(q, k, v, mask, dropout_p)

    def __getstate__(self):  # kernels hold modules and compiled callables: rebuilt on first use
        return {"requested": self.requested}

    def __setstate__(self, state):
        self.__init__(state["requested"])
