"""GR00T N1.6 (`Gr00tN1d6`): the Eagle3-VL backbone and the flow-matching action head, with the
reference's parameter names, so an Isaac-GR00T checkpoint loads by name (ckpt/gr00t.py) and a
LoongForge run exports one. Knows nothing of parallelism, precision policies or checkpointing:
those are applied from outside (train/parallel/parallelize.py).

Inputs (the processor's output, train/data/processor.py), B samples with V images each:

  pixel_values    (B*V, 3, H, W)  normalized (x - 0.5) / 0.5, sample-major, H and W multiples of 28
  input_ids       (B, L)          chat-template prompt, left-padded, V * H/28 * W/28 image tokens
  attention_mask  (B, L)          1 for real tokens
  state           (B, 1, max_state_dim)            normalized, zero-padded
  action          (B, H, max_action_dim)           normalized, zero-padded (training)
  action_mask     (B, H, max_action_dim)           1 where the loss counts (real rows and dims)
  embodiment_id   (B,)            projector index of the embodiment tag

What trains follows the config's `tune_*` switches as the reference sets them (`trainable`), and
the frozen parts run in eval mode while the model trains (no dropout in a frozen DiT).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge.train.model.action_head import ActionHead, flow_time
from loongforge.train.model.attention import Attention, bind_attention
from loongforge.train.model.backbone import Backbone
from loongforge.train.model.config import GrootConfig


class Gr00tN1d6(nn.Module):
    def __init__(self, cfg: GrootConfig, attention: str = "auto"):
        super().__init__()
        self.cfg = cfg
        attn = Attention(attention)
        self.backbone = Backbone(cfg, attn)
        self.action_head = ActionHead(cfg)
        bind_attention(self.action_head, attn)
        self.set_trainable()

    # ---- what trains --------------------------------------------------------------------------
    def frozen_modules(self) -> list[nn.Module]:
        """The modules the tune_* switches freeze whole (their parameters, and dropout in training)."""
        c, eagle, head = self.cfg, self.backbone.model, self.action_head
        out = []
        if not c.tune_visual:
            out += [eagle.vision_model, eagle.mlp1]
        if not c.tune_projector:
            out += [head.state_encoder, head.action_encoder, head.action_decoder]
            out += [head.position_embedding] if head.position_embedding is not None else []
        if not c.tune_diffusion_model:
            out.append(head.model)
        if not c.tune_vlln:
            out.append(head.vlln)
        return out

    def set_trainable(self) -> None:
        """requires_grad as the reference sets it: everything, then the frozen parts off, then the top
        `tune_top_llm_layers` LLM layers back on. The vision pooling head never runs: never trains."""
        c, eagle = self.cfg, self.backbone.model
        self.requires_grad_(True)
        if not c.tune_llm:
            eagle.language_model.requires_grad_(False)
        for m in self.frozen_modules():
            m.requires_grad_(False)
        layers = eagle.language_model.model.layers
        for layer in list(layers)[max(0, len(layers) - c.tune_top_llm_layers):] if c.tune_top_llm_layers else []:
            layer.requires_grad_(True)
        if self.action_head.mask_token is not None:  # the reference freezes it with the projectors
            self.action_head.mask_token.requires_grad_(c.tune_projector)
        eagle.vision_model.vision_model.head.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        if mode:
            eagle = self.backbone.model
            frozen = self.frozen_modules() + ([eagle.language_model] if not self.cfg.tune_llm else [])
            for m in frozen:
                m.eval()
        return self

    # ---- forward ------------------------------------------------------------------------------
    def encode(self, inputs: dict) -> dict:
        """Backbone + the action head's shared conditioning (vlln features, cross masks, state)."""
        bb = self.backbone(inputs["pixel_values"], inputs["input_ids"], inputs["attention_mask"])
        return self.action_head.condition(bb, inputs["state"], inputs["embodiment_id"])

    def forward(self, inputs: dict, noise: torch.Tensor, u: torch.Tensor,
                denom: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """noise (B, H, max_action_dim) ~ N(0, 1) and u (B,) uniform come from the caller (seeded per
        sample); t = flow_time(u). The loss is the masked squared error summed over the action
        mask / `denom`: by default the mask's own sum (the reference's masked mean); a caller that
        splits one batch over several backward passes passes what each part stands for."""
        cond = self.encode(inputs)
        if self.action_head.mask_token is not None and self.training:
            u_drop = inputs.get("state_dropout_u")
            if u_drop is None:
                raise ValueError("state dropout: inputs['state_dropout_u'] (B,) uniform draws are needed in training")
            cond = self.action_head.drop_state(cond, u_drop)
        t = flow_time(u, self.cfg).to(noise.device)
        out = self.action_head.loss(cond, inputs["action"].float(), inputs["action_mask"].float(), noise.float(), t,
                                    denom)
        return {"loss": out["loss"], "flow_loss": out["loss"].detach()}

    @torch.no_grad()
    def get_action(self, inputs: dict, noise: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Euler integration of the flow from `noise` (B, H, max_action_dim) -> normalized actions."""
        cond = self.encode(inputs)
        return self.action_head.sample(cond, noise, steps or self.cfg.num_inference_timesteps).float()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
