"""N1.6's flow-matching action head: per-embodiment state encoder, action encoder and decoder, the
vlln LayerNorm on the backbone features, a learned position embedding over the action horizon, and
the AlternateVLDiT between them. Names are the checkpoint's (`action_head.state_encoder.layer1.W`,
`action_head.action_encoder.W1.W`, `action_head.model...`, `action_head.vlln`, ...).

Flow matching as N1.6 trains it: t = (1 - s) * noise_s with s ~ Beta(alpha, beta), x_t = (1 - t)
noise + t action, target velocity action - noise, the DiT and encoder see t bucketed into
`num_timestep_buckets` integers, and the loss is the MSE over the action mask. The caller draws
the noise and a uniform u per sample (seeded, so a resumed run draws what an uninterrupted one
would); `flow_time` turns u into t by the inverse CDF of Beta(alpha, 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.train.model.config import GrootConfig
from loongforge.train.model.dit import AlternateVLDiT
from loongforge.train.model.mask import cross_masks


class CategorySpecificLinear(nn.Module):
    """One linear per embodiment: W (E, in, out), b (E, out); row i uses its embodiment's slice."""

    def __init__(self, categories: int, d_in: int, d_out: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(categories, d_in, d_out))
        self.b = nn.Parameter(torch.zeros(categories, d_out))

    def forward(self, x: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.W[cat]) + self.b[cat][:, None]


class CategorySpecificMLP(nn.Module):
    def __init__(self, categories: int, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(categories, d_in, hidden)
        self.layer2 = CategorySpecificLinear(categories, hidden, d_out)

    def forward(self, x, cat):
        return self.layer2(F.relu(self.layer1(x, cat)), cat)


def sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, T) -> (B, T, dim): [sin | cos] of t * 10000^(-i / (dim/2))."""
    half = dim // 2
    step = torch.log(torch.tensor(10000.0, device=t.device)) / half  # float32, as the reference computes it
    freqs = torch.exp(-torch.arange(half, dtype=torch.float32, device=t.device) * step)
    args = t.float()[..., None] * freqs
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class MultiEmbodimentActionEncoder(nn.Module):
    def __init__(self, action_dim: int, width: int, categories: int):
        super().__init__()
        self.width = width
        self.W1 = CategorySpecificLinear(categories, action_dim, width)
        self.W2 = CategorySpecificLinear(categories, 2 * width, width)
        self.W3 = CategorySpecificLinear(categories, width, width)

    def forward(self, actions: torch.Tensor, t_bucket: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        a = self.W1(actions, cat)
        tau = sinusoid(t_bucket[:, None].expand(-1, actions.shape[1]), self.width).to(a.dtype)
        x = self.W2(torch.cat([a, tau], dim=-1), cat)
        return self.W3(x * torch.sigmoid(x), cat)


def flow_time(u: torch.Tensor, cfg: GrootConfig) -> torch.Tensor:
    """Uniform u in [0, 1) -> t = (1 - s) * noise_s, s ~ Beta(alpha, 1) by its inverse CDF u**(1/alpha)."""
    if cfg.noise_beta_beta != 1.0:
        raise ValueError("flow_time: only Beta(alpha, 1) has a closed-form inverse CDF (N1.6: Beta(1.5, 1))")
    s = u.float().clamp(0.0, 1.0) ** (1.0 / cfg.noise_beta_alpha)
    return (1.0 - s) * cfg.noise_s


class PositionEmbedding(nn.Embedding):
    """The action horizon's learned positions, N(0, 0.02) from the start. The draw lives in the
    module's own reset_parameters: under deepspeed.zero.Init a module's parameters are partitioned as
    its __init__ returns, so a parent re-initialising a child's weight afterwards writes into an empty
    partition and a 1-rank ZeRO-3 run would start from other weights than a ZeRO-0 run."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class ActionHead(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.cfg = cfg
        e, w = cfg.max_num_embodiments, cfg.input_embedding_dim
        self.model = AlternateVLDiT(cfg.dit, cfg.backbone_embedding_dim, cfg.attend_text_every_n_blocks)
        self.state_encoder = CategorySpecificMLP(e, cfg.max_state_dim, cfg.hidden_size, w)
        self.action_encoder = MultiEmbodimentActionEncoder(cfg.max_action_dim, w, e)
        self.action_decoder = CategorySpecificMLP(e, cfg.hidden_size, cfg.hidden_size, cfg.max_action_dim)
        self.vlln = nn.LayerNorm(cfg.backbone_embedding_dim) if cfg.use_vlln else nn.Identity()
        self.position_embedding = PositionEmbedding(cfg.max_seq_len, w) if cfg.add_pos_embed else None
        # N1.6's state dropout: a sample's state tokens replaced by a learned token (only when > 0, as N1.6;
        # its value is set as it is created, so ZeRO-3's partitioning at the end of __init__ keeps it)
        self.mask_token = nn.Parameter(0.02 * torch.randn(1, 1, w)) if cfg.state_dropout_prob > 0 else None

    def bucket(self, t: torch.Tensor) -> torch.Tensor:
        return (t * self.cfg.num_timestep_buckets).long()

    def condition(self, backbone: dict, state: torch.Tensor, embodiment: torch.Tensor) -> dict:
        """What every denoising step shares: vlln(features), the two cross masks, state tokens."""
        text, image = cross_masks(backbone["image_mask"], backbone["backbone_attention_mask"])
        feats = self.vlln(backbone["backbone_features"])
        return {"features": feats, "text_keys": text, "image_keys": image,
                "state_features": self.state_encoder(state.to(feats.dtype), embodiment), "embodiment": embodiment}

    def drop_state(self, cond: dict, u: torch.Tensor) -> dict:
        """Training: the state features of samples with u < state_dropout_prob become the mask token
        (u (B,) uniform, drawn per sample by the caller: model/noise.py)."""
        feats = cond["state_features"]
        drop = (u.to(feats.device) < self.cfg.state_dropout_prob)[:, None, None].to(feats.dtype)
        return {**cond, "state_features": feats * (1 - drop) + self.mask_token.to(feats.dtype) * drop}

    def velocity(self, cond: dict, x: torch.Tensor, t_bucket: torch.Tensor) -> torch.Tensor:
        """(B, H, max_action_dim) noisy actions, (B,) timestep buckets -> (B, H, max_action_dim)."""
        emb = cond["embodiment"]
        a = self.action_encoder(x.to(cond["features"].dtype), t_bucket, emb)
        if self.position_embedding is not None:
            a = a + self.position_embedding.weight[: a.shape[1]][None]
        out = self.model(torch.cat([cond["state_features"], a], dim=1), cond["features"], t_bucket,
                         cond["text_keys"], cond["image_keys"])
        return self.action_decoder(out, emb)[:, -x.shape[1]:]

    def loss(self, cond: dict, action, action_mask, noise, t, denom=None) -> dict:
        """Flow-matching loss: masked squared velocity error summed / denom (default the mask's
        sum + 1e-6, the reference's masked mean)."""
        tt = t[:, None, None]
        xt = (1 - tt) * noise + tt * action
        pred = self.velocity(cond, xt, self.bucket(t)).float()
        err = F.mse_loss(pred, (action - noise).float(), reduction="none") * action_mask
        denom = action_mask.sum() + 1e-6 if denom is None else denom
        return {"loss": err.sum() / denom, "pred_velocity": pred, "action_loss": err}

    @torch.no_grad()
    def sample(self, cond: dict, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """Euler integration from `noise` over `steps` steps (N1.6: 4): t = 0, 1/steps, ..."""
        x = noise.to(cond["features"].dtype)
        b, dt = x.shape[0], 1.0 / steps
        for i in range(steps):
            t_bucket = torch.full((b,), int(i / steps * self.cfg.num_timestep_buckets), device=x.device)
            x = x + dt * self.velocity(cond, x, t_bucket)
        return x
