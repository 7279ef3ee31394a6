"""The multimodal attention mask (boolean, True = may attend), for SDPA.

Sequence layout per sample: [prefix | action], prefix = vision patches of every
camera and frame, one proprioceptive-state token per frame, then language.

  prefix -> prefix : bidirectional, over valid keys only (bucketing pads frames,
                     text is padded to a fixed length);
  prefix -> action : never (the observation encoding must not see the answer);
  action -> prefix : every valid key;
  action -> action : causal (j <= i).

A query row with no valid key makes SDPA return NaN, so padded prefix queries
attend to themselves only; their outputs are never read by a loss.
"""

from __future__ import annotations

import torch


def prefix_valid(frame_mask: torch.Tensor, task_mask: torch.Tensor, *, cameras: int, patches: int) -> torch.Tensor:
    """(B, K) frames, (B, L) text -> (B, cameras*K*patches + K + L) validity of prefix tokens."""
    b, k = frame_mask.shape
    vision = frame_mask[:, None, :, None].expand(b, cameras, k, patches).reshape(b, cameras * k * patches)
    return torch.cat([vision, frame_mask, task_mask], dim=1)


def build_mask(valid: torch.Tensor, n_action: int) -> torch.Tensor:
    """(B, Np) prefix validity -> (B, 1, N, N) boolean mask, N = Np + n_action."""
    b, np_ = valid.shape
    n = np_ + n_action
    dev = valid.device
    key_ok = torch.cat([valid, torch.ones(b, n_action, dtype=torch.bool, device=dev)], dim=1)  # (B, N)
    is_action = torch.arange(n, device=dev) >= np_
    qi = torch.arange(n, device=dev)[:, None]
    kj = torch.arange(n, device=dev)[None, :]
    # Structure shared by the batch: which (query, key) pairs the layout allows.
    allowed = torch.where(is_action[:, None], ~is_action[None, :] | (kj <= qi), ~is_action[None, :])
    mask = allowed[None] & key_ok[:, None, :]
    eye = torch.eye(n, dtype=torch.bool, device=dev)[None]
    dead_query = ~key_ok[:, :, None]  # padded prefix queries: self only
    mask = torch.where(dead_query, eye, mask)
    return mask[:, None]
