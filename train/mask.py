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
the layout a varlen kernel wants. The dense boolean masks SDPA takes are derived from it here
and nowhere else.

A query row with no valid key makes SDPA return NaN: padded vl queries attend to themselves,
and a cross-attention row of a sample with no valid vl token (a bad sample, masked out of the
loss) attends to key 0. Neither output is ever read by a loss.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def vl_self_mask(valid: torch.Tensor) -> torch.Tensor:
    """vl -> vl: (B, N) validity -> (B, 1, N, N)."""
    n = valid.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=valid.device)[None]
    mask = valid[:, None, :].expand(-1, n, -1)
    return torch.where(~valid[:, :, None], eye, mask)[:, None]


def cross_mask(valid: torch.Tensor) -> torch.Tensor:
    """act -> vl and bins -> vl: (B, N) validity -> (B, 1, 1, N), broadcast over queries."""
    empty = ~valid.any(1, keepdim=True)
    first = torch.zeros_like(valid)
    first[:, 0] = True
    return (valid | (empty & first))[:, None, None]


def causal_mask(n: int, device) -> torch.Tensor:
    """bins -> bins: (n, n), query i sees keys j <= i."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
