"""The attention masks of N1.6: one definition, as descriptions the kernels turn into what they need.

Four attention sites, three kinds (True = may attend):

  vision   SigLIP2, within one image       full, no mask (None): images are a batch dimension
  llm      Qwen3 over [chat text | images] `Causal(valid)`: key j <= query i, valid keys only
           (the collator pads on the left, so each row's valid tokens are a suffix)
  dit self state + action tokens           full, no mask (None): every token is real
  dit cross -> backbone features            `Keys(keys)`: every query sees the True keys of its row
           (non-image tokens in blocks 0, 4, 8, ..., image tokens in 2, 6, 10, ...; valid ones only)

A query row with no key it may see makes a softmax of nothing (NaN in SDPA). The rules close that
hole without touching a row that has one: a padded LLM query also sees itself (its output is never
read: the DiT masks padded features out), and a cross-attention row of a sample with no key of the
block's kind (a bad sample the loss masks out) sees key 0.

The rule of each kind is written once, pointwise (`rule`); SDPA's dense boolean mask (`dense`) and
FlexAttention's mask_mod are that predicate, and the flash path derives its varlen tables from the
same (B, N) validity. Each description caches what a kernel derived from it, so the layers of one
forward pass build it once.
"""

from __future__ import annotations

from typing import Callable

import torch


class _Cached:
    __slots__ = ("_cache",)

    def __init__(self):
        self._cache: dict = {}

    def cached(self, key, build: Callable):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


class Causal(_Cached):
    """LLM self-attention: causal over the (B, N) valid keys (a suffix of each row)."""

    __slots__ = ("valid",)

    def __init__(self, valid: torch.Tensor):
        super().__init__()
        self.valid = valid


class Keys(_Cached):
    """Cross-attention: every query of row b sees keys[b] (B, Nk), or key 0 when the row has none."""

    __slots__ = ("keys",)

    def __init__(self, keys: torch.Tensor):
        super().__init__()
        self.keys = keys

    def safe(self) -> torch.Tensor:
        def build():
            empty = ~self.keys.any(1, keepdim=True)
            first = torch.zeros_like(self.keys)
            first[:, 0] = True
            return self.keys | (empty & first)

        return self.cached("safe", build)


def cross_masks(image_mask: torch.Tensor, attention_mask: torch.Tensor) -> tuple[Keys, Keys]:
    """(text keys, image keys) of the DiT's alternating cross-attention: valid non-image tokens,
    valid image tokens."""
    return Keys(~image_mask & attention_mask), Keys(image_mask & attention_mask)


# ---- the rules, pointwise: b, q, kv are index tensors (broadcast grids, or scalars under vmap) ----
def causal_rule(valid: torch.Tensor) -> Callable:
    return lambda b, q, kv: ((kv <= q) & valid[b, kv]) | (q == kv)


def keys_rule(keys: torch.Tensor) -> Callable:
    return lambda b, q, kv: keys[b, kv] | (q < 0)  # `| (q < 0)` broadcasts over queries


def rule(mask) -> Callable:
    """The pointwise predicate of a description (FlexAttention's mask_mod, minus the head)."""
    if isinstance(mask, Causal):
        return causal_rule(mask.valid)
    if isinstance(mask, Keys):
        return keys_rule(mask.safe())
    raise TypeError(f"no rule for {mask!r} (None means no mask)")


def _grid(r: Callable, b: int, nq: int, nk: int, device) -> torch.Tensor:
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    return r(ar(b)[:, None, None], ar(nq)[None, :, None], ar(nk)[None, None, :])


def dense(mask, nq: int) -> torch.Tensor | None:
    """The reference: the boolean tensor SDPA takes ((B, 1, N, N), (B, 1, 1, Nk) or None)."""
    if mask is None:
        return None
    if isinstance(mask, Causal):
        v = mask.valid
        return mask.cached("dense", lambda: _grid(causal_rule(v), v.shape[0], v.shape[1], v.shape[1], v.device)[:, None])
    if isinstance(mask, Keys):
        return mask.cached("dense", lambda: mask.safe()[:, None, None])
    raise TypeError(f"no dense form for {mask!r}")
