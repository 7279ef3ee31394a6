"""What the model-level tests share: a reduced GR00T N1.6 (the tiny recipe, DiT dropout off so that
layouts and kernels compare exactly) and the inputs the processor hands it, built directly:
left-padded chat prompts with the images' tokens, images, state, action and a partial action mask."""

from __future__ import annotations

import torch

from loongforge.train.model.model import Gr00tN1d6
from loongforge.train.recipes import tiny

CFG = tiny().model.replace(dit={"dropout": 0.0}, action_horizon=4, max_state_dim=6, max_action_dim=5)


def build(cfg=CFG, attention: str = "sdpa", seed: int = 0) -> Gr00tN1d6:
    torch.manual_seed(seed)
    return Gr00tN1d6(cfg, attention=attention)


def make_inputs(seed: int, *, b: int = 4, v: int = 3, hw: tuple[int, int] = (84, 56), cfg=CFG,
                extra_text: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(inputs, noise, u) for b samples of v images of hw pixels each. Row i's prompt carries 3 + i
    (+ extra_text) text tokens, so the rows are left-padded by different amounts."""
    g = torch.Generator().manual_seed(100 + seed)
    per_image = (hw[0] // 28) * (hw[1] // 28)
    img, rows = cfg.image_token_index, []
    for r in range(b):
        text = torch.randint(0, 256, (3 + r + extra_text,), generator=g).tolist()
        rows.append(text[:2] + [img] * per_image + text[2:] + [img] * (v - 1) * per_image + [257, 258])
    width = max(len(r) for r in rows)
    input_ids = torch.full((b, width), 256)
    attention_mask = torch.zeros(b, width, dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, width - len(ids):] = torch.tensor(ids)  # left padding, as the collator
        attention_mask[i, width - len(ids):] = 1
    h, dims = cfg.action_horizon, cfg.max_action_dim
    action_mask = torch.ones(b, h, dims)
    action_mask[:, :, 3:] = 0  # a 3-D robot in wider slots
    if b > 2:
        action_mask[2, h - 1:] = 0  # a chunk past the episode end
    inputs = {"pixel_values": torch.rand(b * v, 3, *hw, generator=g) * 2 - 1, "input_ids": input_ids,
              "attention_mask": attention_mask, "state": torch.randn(b, 1, cfg.max_state_dim, generator=g),
              "action": torch.randn(b, h, dims, generator=g) * action_mask, "action_mask": action_mask,
              "embodiment_id": torch.tensor([1, 10, 10, 3] * (b // 4 + 1))[:b]}
    return inputs, torch.randn(b, h, dims, generator=g), torch.rand(b, generator=g)


def to(inputs: dict, device, dtype=None) -> dict:
    return {k: (v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device))
            for k, v in inputs.items()}
