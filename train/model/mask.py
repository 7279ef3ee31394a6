"""The multimodal attention masks: one definition, built from segments.

Three token streams (see train/README.md for the table):

  vl    vision-language trunk: [vision camera 0 | ... | vision camera C-1 | state | text]
        vision camera c = K frames x T pooled tokens, frame-major; state = one token per frame;
        text = L byte tokens.
  act   action head (DiT): [state | noisy action 0..H-1]
  bins  discrete head: [query | ground-truth action 0..H-2, shifted by one]

Rules (True = may attend):

  vl   -> vl   : bidirectional, valid keys only (frames are padded to a bucket, text to a length)
  act  -> act  : bidirectional (every token is real)
  act  -> vl   : valid keys only (cross-attention)
  bins -> bins : causal (j <= i), so logit i never sees ground-truth action i or later
  bins -> vl   : valid keys only (cross-attention)
  nothing attends to act or bins from vl: the observation encoding never sees an action.

Within each vl segment the valid tokens are a prefix (the loader marks the first k frames real
and text is left-aligned), so a batch's validity is one (B, segments) table of valid lengths,
the layout a varlen kernel wants. So every attention here is one of three kinds, described
(not materialised) by `VLSelf`, `VLCross`, `Causal` or None:

  full attention over the valid vl keys   vl -> vl (VLSelf), act/bins -> vl (VLCross)
  causal                                   bins -> bins (Causal)
  full, no mask                            act -> act (None)

The rules are written once, pointwise, as `allowed(mask)(b, q, kv)`. The dense boolean masks
SDPA takes are that predicate on broadcast index grids (`dense`), FlexAttention's mask_mod is
the same predicate, and the varlen/block tables of the other backends (train/model/attention.py) are
derived from the same (B, N) key validity. Backends build what they need once per batch and
cache it on the `VLLayout`.

A query row with no valid key makes SDPA return NaN: padded vl queries attend to themselves,
and a cross-attention row of a sample with no valid vl token (a bad sample, masked out of the
loss) attends to key 0. Neither output is ever read by a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    length: int


def vl_segments(*, cameras: int, frames: int, tokens_per_frame: int, text_len: int) -> tuple[Segment, ...]:
    """The trunk layout, in sequence order."""
    vision = tuple(Segment(f"vision{c}", frames * tokens_per_frame) for c in range(cameras))
    return vision + (Segment("state", frames), Segment("text", text_len))


def vl_valid_lengths(frame_mask: torch.Tensor, task_mask: torch.Tensor, *, cameras: int,
                     tokens_per_frame: int) -> torch.Tensor:
    """(B, K) real frames, (B, L) real text -> (B, cameras + 2) valid length of each vl segment."""
    frames = frame_mask.sum(1)
    text = task_mask.sum(1)
    vision = (frames * tokens_per_frame)[:, None].expand(-1, cameras)
    return torch.cat([vision, frames[:, None], text[:, None]], dim=1)


def key_valid(segments: tuple[Segment, ...], lengths: torch.Tensor) -> torch.Tensor:
    """(B, segments) valid lengths -> (B, N) per-token validity (N = total length)."""
    dev = lengths.device
    pos = torch.cat([torch.arange(s.length, device=dev) for s in segments])  # position within its segment
    seg = torch.cat([torch.full((s.length,), i, device=dev) for i, s in enumerate(segments)])
    return pos[None, :] < lengths[:, seg]


# ---- the rules, pointwise: b, q, kv are index tensors (broadcast grids, or scalars under vmap) ----
def vl_self_rule(valid: torch.Tensor) -> Callable:
    """vl -> vl: valid queries see valid keys; a padded query sees only itself (no NaN row)."""
    return lambda b, q, kv: (valid[b, q] & valid[b, kv]) | (q == kv)


def cross_rule(keys: torch.Tensor) -> Callable:
    """act/bins -> vl: every query sees the (B, N) `cross_keys`."""
    return lambda b, q, kv: keys[b, kv] | (q < 0)  # `| (q < 0)` broadcasts over queries


def causal_rule(b, q, kv):
    """bins -> bins: query i sees keys j <= i."""
    return kv <= q


def _grid(rule: Callable, b: int, nq: int, nk: int, device) -> torch.Tensor:
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    return rule(ar(b)[:, None, None], ar(nq)[None, :, None], ar(nk)[None, None, :])


def cross_keys(valid: torch.Tensor) -> torch.Tensor:
    """(B, N) validity -> the keys a cross-attention query sees: the valid ones, or key 0 alone
    for a sample with none (a bad sample, masked out of the loss)."""
    empty = ~valid.any(1, keepdim=True)
    first = torch.zeros_like(valid)
    first[:, 0] = True
    return valid | (empty & first)


def vl_self_mask(valid: torch.Tensor) -> torch.Tensor:
    """vl -> vl: (B, N) validity -> (B, 1, N, N)."""
    b, n = valid.shape
    return _grid(vl_self_rule(valid), b, n, n, valid.device)[:, None]


def cross_mask(valid: torch.Tensor) -> torch.Tensor:
    """act -> vl and bins -> vl: (B, N) validity -> (B, 1, 1, N), broadcast over queries."""
    return cross_keys(valid)[:, None, None]


def causal_mask(n: int, device) -> torch.Tensor:
    """bins -> bins: (n, n), query i sees keys j <= i."""
    return _grid(causal_rule, 1, n, n, device)[0]


# ---- descriptions the attention backends consume ----------------------------------------------
class VLLayout:
    """One batch's vl layout: segments + (B, segments) valid lengths, and whatever a backend
    derives from them (dense mask, block table, varlen indices), built once on first use and
    shared by every layer of the forward pass."""

    def __init__(self, segments: tuple[Segment, ...], lengths: torch.Tensor):
        self.segments, self.lengths = segments, lengths
        self._cache: dict = {}

    @property
    def n(self) -> int:
        return sum(s.length for s in self.segments)

    def cached(self, key, build: Callable):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def valid(self) -> torch.Tensor:
        """(B, N) key validity."""
        return self.cached("valid", lambda: key_valid(self.segments, self.lengths))

    def cross_keys(self) -> torch.Tensor:
        return self.cached("cross_keys", lambda: cross_keys(self.valid()))


@dataclass(frozen=True, eq=False, slots=True)
class VLSelf:
    """vl -> vl: full attention over the valid keys (padded queries see themselves)."""
    layout: VLLayout


@dataclass(frozen=True, eq=False, slots=True)
class VLCross:
    """act/bins -> vl: full attention over the valid keys (`cross_keys`)."""
    layout: VLLayout


@dataclass(frozen=True, slots=True)
class Causal:
    """bins -> bins, n tokens, all real."""
    n: int


def rule(mask) -> Callable:
    """The pointwise predicate of a description (FlexAttention's mask_mod, minus the head)."""
    if isinstance(mask, VLSelf):
        return vl_self_rule(mask.layout.valid())
    if isinstance(mask, VLCross):
        return cross_rule(mask.layout.cross_keys())
    if isinstance(mask, Causal):
        return causal_rule
    raise TypeError(f"no rule for {mask!r} (None means no mask)")


def dense(mask, device) -> torch.Tensor | None:
    """The reference: the boolean tensor SDPA takes ((B,1,N,N), (B,1,1,N), (n,n) or None)."""
    if mask is None:
        return None
    if isinstance(mask, VLSelf):
        return mask.layout.cached("dense_self", lambda: vl_self_mask(mask.layout.valid()))
    if isinstance(mask, VLCross):
        return mask.layout.cached("dense_cross", lambda: cross_mask(mask.layout.valid()))
    return causal_mask(mask.n, device)
