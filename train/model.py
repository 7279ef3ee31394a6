"""GR00T-like vision-language-action model. Knows nothing of parallelism.

Frames of each camera (RGB float after the device-side conversion) -> patch
embedding; task text -> byte tokens; proprioceptive state -> MLP; one
transformer over [vision | state | language | action] with the multimodal
mask of mask.py. Action tokens carry the noisy action and the flow time; two
heads read them: a flow-matching velocity head (MSE, as GR00T's DiT head) and
a discrete head over binned actions (cross-entropy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.config import ModelConfig
from loongforge.train.mask import build_mask, prefix_valid


def sdpa(q, k, v, mask, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def attention_backend(name: str):
    # Seam for a later flash-attn backend (GPU extra). It needs a varlen/packed
    # layout instead of a dense boolean mask, so it is not a drop-in here yet.
    if name == "sdpa":
        return sdpa
    raise ConfigError(f"model.attention={name!r} is not implemented yet; use 'sdpa'")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn):
        super().__init__()
        self.heads, self.attn, self.dropout = cfg.heads, attn, cfg.dropout
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        hidden = int(cfg.dim * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.dim))

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v, mask, self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim - emb.shape[-1]))


class VLAModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        h, w = cfg.image_size
        self.patches = (h // cfg.patch) * (w // cfg.patch)
        self.patch_embed = nn.Conv2d(3, d, kernel_size=cfg.patch, stride=cfg.patch)
        self.patch_pos = nn.Parameter(torch.zeros(self.patches, d))
        self.camera_emb = nn.Parameter(torch.zeros(cfg.cameras, d))
        self.frame_emb = nn.Parameter(torch.zeros(cfg.max_frames, d))
        self.state_mlp = nn.Sequential(nn.Linear(cfg.state_dim, d), nn.GELU(), nn.Linear(d, d))
        self.tok_emb = nn.Embedding(cfg.vocab, d)
        self.tok_pos = nn.Parameter(torch.zeros(cfg.max_text_tokens, d))
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.action_pos = nn.Parameter(torch.zeros(cfg.action_horizon, d))
        attn = attention_backend(cfg.attention)
        self.blocks = nn.ModuleList([Block(cfg, attn) for _ in range(cfg.depth)])
        self.ln_f = nn.LayerNorm(d)
        self.velocity_head = nn.Linear(d, cfg.action_dim)
        self.bin_head = nn.Linear(d, cfg.action_dim * cfg.action_bins)
        for p in (self.patch_pos, self.camera_emb, self.frame_emb, self.tok_pos, self.action_pos):
            nn.init.normal_(p, std=0.02)

    def _vision(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """list over cameras of (B, K, 3, h, w) -> (B, cameras*K*patches, d)."""
        x = torch.stack(frames, dim=1)  # (B, C, K, 3, h, w)
        b, c, k = x.shape[:3]
        z = self.patch_embed(x.flatten(0, 2)).flatten(2).transpose(1, 2)  # (B*C*K, P, d)
        z = z.view(b, c, k, self.patches, -1)
        z = z + self.patch_pos + self.camera_emb[:c, None, None] + self.frame_emb[:k, None]
        return z.reshape(b, c * k * self.patches, -1)

    def forward(self, batch: dict, noise: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """noise (B, H, Da) ~ N(0, 1) and t (B,) in [0, 1) come from the caller (a seeded
        generator), so a resumed run draws exactly what an uninterrupted one would."""
        cfg, dtype = self.cfg, self.patch_embed.weight.dtype
        frames = [batch["frames"][s].to(dtype) for s in sorted(batch["frames"])]
        state, action = batch["state"].to(dtype), batch["action"].float()
        k = state.shape[1]
        tokens = batch["task_tokens"]
        x1 = action
        tt = t.float()[:, None, None]
        xt = (1.0 - tt) * noise + tt * x1
        a = self.action_in(xt.to(dtype)) + self.action_pos + self.time_mlp(timestep_embedding(t, cfg.dim).to(dtype))[:, None]
        seq = torch.cat([self._vision(frames), self.state_mlp(state) + self.frame_emb[:k],
                         self.tok_emb(tokens) + self.tok_pos[: tokens.shape[1]], a], dim=1)
        valid = prefix_valid(batch["frame_mask"], batch["task_mask"], cameras=len(frames), patches=self.patches)
        mask = build_mask(valid, cfg.action_horizon)
        for blk in self.blocks:
            seq = blk(seq, mask)
        out = self.ln_f(seq[:, -cfg.action_horizon:])
        return self._losses(out, x1, noise, batch)

    def _losses(self, out, x1, noise, batch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        weight = (batch["action_valid"] & batch["sample_valid"][:, None]).float()  # (B, H)
        denom = weight.sum().clamp_min(1.0)
        velocity = self.velocity_head(out).float()
        flow = (((velocity - (x1 - noise)) ** 2).mean(-1) * weight).sum() / denom
        logits = self.bin_head(out).float().view(*out.shape[:2], cfg.action_dim, cfg.action_bins)
        scaled = (x1.clamp(-cfg.action_clip, cfg.action_clip) + cfg.action_clip) / (2 * cfg.action_clip)
        target = torch.round(scaled * (cfg.action_bins - 1)).long()
        ce = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none").view(target.shape)
        ce = (ce.mean(-1) * weight).sum() / denom
        loss = cfg.flow_weight * flow + cfg.ce_weight * ce
        return {"loss": loss, "flow_loss": flow.detach(), "ce_loss": ce.detach()}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
