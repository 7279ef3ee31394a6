"""GR00T N1.6-shaped vision-language-action model. Knows nothing of parallelism.

  trunk     frames (resized on the device to the recipe's input size) -> patches -> pixel
            unshuffle to `vision_tokens` per frame and camera; + one state token per frame;
            + byte-level text. Bidirectional transformer over valid tokens -> vl tokens.
  action    DiT-like: [state | noisy action x_t over horizon H], self-attention among these,
  head      cross-attention to the vl tokens (interleaved), adaptive norm on the flow time;
            outputs the velocity (action - noise). Flow-matching MSE.
  discrete  [query | ground-truth action 0..H-2] (teacher forcing, shifted by one), causal
  head      self-attention and cross-attention to the vl tokens -> binned action logits
            (cross-entropy). It never reads x_t, nor the action it predicts.

Masks: mask.py (one definition); kernels: attention.py. Layout table: train/README.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model import mask as masks
from loongforge.train.config import ModelConfig
from loongforge.train.model.layers import (AdaNorm, HeadBlock, TrunkBlock, attention_backend, flow_time,
                                     timestep_embedding)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * 0.02)


class TrunkTokens:
    """Where the trunk's token sequence may be re-cut: `encode` calls `split` on the full vl
    sequence ([video | state, text], the video span `n_video` long) and its mask description
    before the trunk blocks, and `merge` on their output. This default cuts nothing. A parallel
    plan installs its own from outside (train/parallel/sequence_parallel.py shards the video tokens
    over its SP group): the model stays free of any parallelism import."""

    def split(self, seq: torch.Tensor, n_video: int, mask):
        return seq, mask

    def merge(self, seq: torch.Tensor) -> torch.Tensor:
        return seq


class VLAModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, hd, attn = cfg.dim, cfg.dim // cfg.heads, attention_backend(cfg.attention)
        grid = math.isqrt(cfg.vision_tokens)
        self.input_size = 2 * grid * cfg.patch  # patches on a 2g x 2g grid, unshuffled 2x2 -> g x g tokens
        self.patch_embed = nn.Conv2d(3, d, kernel_size=cfg.patch, stride=cfg.patch)
        self.patch_pos = _param(d, 2 * grid, 2 * grid)
        self.vision_proj = nn.Sequential(nn.LayerNorm(4 * d), nn.Linear(4 * d, d))
        self.camera_emb, self.frame_emb = _param(cfg.cameras, d), _param(cfg.max_frames, d)
        self.state_mlp = nn.Sequential(nn.Linear(cfg.state_dim, d), nn.GELU(), nn.Linear(d, d))
        self.tok_emb, self.tok_pos = nn.Embedding(cfg.vocab, d), _param(cfg.max_text_tokens, d)
        self.blocks = nn.ModuleList([TrunkBlock(d, hd, cfg.mlp_ratio, attn, cfg.dropout)
                                     for _ in range(cfg.depth)])
        self.vl_norm = nn.LayerNorm(d)
        self.trunk_tokens = TrunkTokens()  # a plan may replace it (sequence parallel on the video span)
        # Action head (flow matching).
        self.head_state = nn.Sequential(nn.Linear(cfg.state_dim, d), nn.GELU(), nn.Linear(d, d))
        self.action_in = nn.Sequential(nn.Linear(cfg.action_dim, d), nn.GELU(), nn.Linear(d, d))
        self.action_pos = _param(cfg.action_horizon + 1, d)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.head_blocks = nn.ModuleList([HeadBlock(d, hd, cfg.mlp_ratio, attn, cross=i % 2 == 0, conditioned=True)
                                          for i in range(cfg.head_depth)])
        self.head_norm = AdaNorm(d)
        self.velocity_out = nn.Linear(d, cfg.action_dim)
        # Discrete head (binned actions, teacher forcing).
        self.bin_query = _param(1, d)
        self.bin_in = nn.Linear(cfg.action_dim, d)
        self.bin_pos = _param(cfg.action_horizon, d)
        self.bin_blocks = nn.ModuleList([HeadBlock(d, hd, cfg.mlp_ratio, attn, cross=i % 2 == 0, conditioned=False)
                                         for i in range(cfg.bin_depth)])
        self.bin_norm = nn.LayerNorm(d)
        self.bin_out = nn.Linear(d, cfg.action_dim * cfg.action_bins)

    # ---- trunk -------------------------------------------------------------------------------
    def _vision(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """list over cameras of (B, K, 3, h, w) -> (B, cameras*K*T, d), camera-major then frame."""
        x = torch.stack(frames, dim=1)  # (B, C, K, 3, h, w)
        b, c, k = x.shape[:3]
        x = x.flatten(0, 2)
        s = self.input_size
        if tuple(x.shape[-2:]) != (s, s):
            # NOTE: the step cost must not depend on the dataset's resolution (GR00T resizes to 224).
            x = F.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        z = self.patch_embed(x) + self.patch_pos  # (N, d, 2g, 2g)
        z = F.pixel_unshuffle(z, 2).flatten(2).transpose(1, 2)  # (N, T, 4d): GR00T's pixel shuffle
        z = self.vision_proj(z).view(b, c, k, self.cfg.vision_tokens, -1)
        z = z + self.camera_emb[:c, None, None] + self.frame_emb[:k, None]
        return z.reshape(b, c * k * self.cfg.vision_tokens, -1)

    def encode(self, batch: dict) -> tuple[torch.Tensor, masks.VLLayout]:
        """Observation -> (vl tokens (B, N, d), their layout: segments + valid lengths)."""
        dtype = self.patch_embed.weight.dtype
        frames = [batch["frames"][s].to(dtype) for s in sorted(batch["frames"])]
        state, tokens = batch["state"].to(dtype), batch["task_tokens"]
        k = state.shape[1]
        video = self._vision(frames)
        seq = torch.cat([video, self.state_mlp(state) + self.frame_emb[:k],
                         self.tok_emb(tokens) + self.tok_pos[: tokens.shape[1]]], dim=1)
        segs = masks.vl_segments(cameras=len(frames), frames=k, tokens_per_frame=self.cfg.vision_tokens,
                                 text_len=tokens.shape[1])
        lengths = masks.vl_valid_lengths(batch["frame_mask"], batch["task_mask"], cameras=len(frames),
                                         tokens_per_frame=self.cfg.vision_tokens)
        layout = masks.VLLayout(segs, lengths)  # masks are built lazily, by the backend that needs them
        seq, mask = self.trunk_tokens.split(seq, video.shape[1], masks.VLSelf(layout))
        for blk in self.blocks:
            seq = blk(seq, mask)
        return self.vl_norm(self.trunk_tokens.merge(seq)), layout

    # ---- heads -------------------------------------------------------------------------------
    def velocity(self, vl, layout, state, xt, t) -> torch.Tensor:
        """Action head: (B, Ds) current state, (B, H, Da) x_t, (B,) t -> (B, H, Da) velocity."""
        dtype = vl.dtype
        x = torch.cat([self.head_state(state.to(dtype))[:, None], self.action_in(xt.to(dtype))], dim=1)
        x = x + self.action_pos
        cond = self.time_mlp(timestep_embedding(t, self.cfg.dim).to(dtype))
        cm = masks.VLCross(layout)
        for blk in self.head_blocks:
            x = blk(x, context=vl, self_mask=None, cross_mask=cm, cond=cond)
        return self.velocity_out(self.head_norm(x, cond)[:, 1:]).float()

    def bin_logits(self, vl, layout, prev: torch.Tensor) -> torch.Tensor:
        """Discrete head: (B, H, Da) ground-truth (dequantized) actions -> (B, H, Da, bins) logits.
        Position i reads prev[:, :i] only: the input is shifted by one and the self mask causal."""
        b, h, _ = prev.shape
        shifted = self.bin_in(prev[:, :-1].to(vl.dtype))
        x = torch.cat([self.bin_query.expand(b, 1, -1), shifted], dim=1) + self.bin_pos
        cm, sm = masks.VLCross(layout), masks.Causal(h)
        for blk in self.bin_blocks:
            x = blk(x, context=vl, self_mask=sm, cross_mask=cm)
        out = self.bin_out(self.bin_norm(x)).float()
        return out.view(b, h, self.cfg.action_dim, self.cfg.action_bins)

    def to_bins(self, action: torch.Tensor) -> torch.Tensor:
        c, n = self.cfg.action_clip, self.cfg.action_bins
        return torch.round((action.float().clamp(-c, c) + c) / (2 * c) * (n - 1)).long()

    def from_bins(self, bins: torch.Tensor) -> torch.Tensor:
        c, n = self.cfg.action_clip, self.cfg.action_bins
        return bins.float() / (n - 1) * (2 * c) - c

    @staticmethod
    def current_state(batch: dict) -> torch.Tensor:
        """The state of the last real frame of each sample: the action head's state token."""
        last = (batch["frame_mask"].sum(1) - 1).clamp_min(0)
        return batch["state"][torch.arange(len(last), device=last.device), last]

    # ---- training ----------------------------------------------------------------------------
    def forward(self, batch: dict, noise: torch.Tensor, u: torch.Tensor,
                rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """noise (B, H, Da) ~ N(0, 1) and u (B,) uniform in [0, 1) come from the caller (seeded per
        sample), so a resumed run draws exactly what an uninterrupted one would. t = flow_time(u).

        The losses are sums over the valid action rows (`loss_weight`) divided by `rows`: by default
        this batch's own count, a masked mean. A caller that splits one batch over several backward
        passes and averages their gradients passes the count each part stands for instead (the
        trainer: the global count / parts), so the gradient does not depend on the split."""
        vl, layout = self.encode(batch)
        x1 = batch["action"].float()
        t = flow_time(u, self.cfg.time_schedule)
        xt = (1.0 - t[:, None, None]) * noise + t[:, None, None] * x1
        velocity = self.velocity(vl, layout, self.current_state(batch), xt, t)
        target = self.to_bins(x1)
        logits = self.bin_logits(vl, layout, self.from_bins(target))
        return self._losses(velocity, logits, x1 - noise, target, batch, rows)

    def _losses(self, velocity, logits, v_target, target, batch, rows) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        weight = loss_weight(batch)
        denom = weight.sum().clamp_min(1.0) if rows is None else rows
        flow = (((velocity - v_target) ** 2).mean(-1) * weight).sum() / denom
        ce = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none").view(target.shape)
        ce = (ce.mean(-1) * weight).sum() / denom
        loss = cfg.flow_weight * flow + cfg.ce_weight * ce
        return {"loss": loss, "flow_loss": flow.detach(), "ce_loss": ce.detach()}

    # ---- inference ---------------------------------------------------------------------------
    @torch.inference_mode()
    def predict_action(self, batch: dict, steps: int = 4, seed: int = 0) -> torch.Tensor:
        """Euler integration of the flow from Gaussian noise (GR00T: 4 steps) -> (B, H, Da)
        normalized actions. Deterministic given `seed` (and the device)."""
        vl, layout = self.encode(batch)
        state = self.current_state(batch)
        b, h, da = len(state), self.cfg.action_horizon, self.cfg.action_dim
        g = torch.Generator(device=vl.device).manual_seed(seed)
        x = torch.randn((b, h, da), generator=g, device=vl.device)
        for i in range(steps):
            t = torch.full((b,), i / steps, device=vl.device)
            x = x + self.velocity(vl, layout, state, x, t) / steps
        return x

    @torch.inference_mode()
    def predict_discrete(self, batch: dict) -> torch.Tensor:
        """Greedy decoding of the binned actions, one horizon position at a time -> (B, H, Da)
        normalized actions (bin centres)."""
        vl, layout = self.encode(batch)
        b, h, da = vl.shape[0], self.cfg.action_horizon, self.cfg.action_dim
        bins = torch.zeros((b, h, da), dtype=torch.long, device=vl.device)
        for i in range(h):
            # Positions > i of `bins` are still zeros: the causal mask keeps them out of logit i.
            bins[:, i] = self.bin_logits(vl, layout, self.from_bins(bins))[:, i].argmax(-1)
        return self.from_bins(bins)


def loss_weight(batch: dict) -> torch.Tensor:
    """(B, H) float: 1 for the action rows the losses count (real rows of good samples), else 0."""
    return (batch["action_valid"] & batch["sample_valid"][:, None]).float()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
