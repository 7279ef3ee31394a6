"""The model and one batch for the GPU tests, through the public API only: a recipe resolved against a
shard root (recipes.resolve), the one model builder (build_model), the trainer's loader and its noise.
No test builds the model's classes or a batch's keys by hand, so the GPU tests follow the model when
its internals change (only `model(batch, noise, t)["loss"]`, the trainer's call, is assumed)."""

from __future__ import annotations

import torch

from loongforge.train.config import DataConfig
from loongforge.train.data.training_data import load_training_data, make_loader
from loongforge.train.model import recipes
from loongforge.train.model.build import build_model
from loongforge.train.model.noise import noise_for


def model_and_inputs(root: str, recipe: str = "tiny", *, device="cuda", dtype=torch.float32, batch_size: int = 8,
                     seed: int = 0, **overrides):
    """(model on `device` in `dtype`, (batch, noise, t)): the recipe's model, its first batch of `root`."""
    device = torch.device(device)
    data = DataConfig(root=root, num_workers=0)
    index = load_training_data(data)
    cfg = recipes.resolve(recipe, index, max_text_tokens=data.max_text_tokens, max_frames=index.max_frames,
                          **overrides)
    torch.manual_seed(seed)
    model = build_model(cfg).to(device, dtype)
    loader = make_loader(data, index, batch_size=batch_size, rank=0, world=1, device=device)
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    meta = batch.pop("meta")
    noise, t = noise_for(seed, meta["epoch"], meta["sample_ids"], batch["action"].shape, device)
    return model, (batch, noise, t)


def loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
