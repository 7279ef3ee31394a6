"""The model and one batch for the GPU tests, through the public API only: the run's model planned
against a shard root (train/recipes.py plan_model), the one model builder (build_model), the trainer's
loader, processor and noise. No test builds a batch's keys by hand, so the GPU tests follow the model
when its internals change (only `model(inputs, noise, u)["loss"]`, the trainer's call, is assumed)."""

from __future__ import annotations

import torch

from loongforge.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from loongforge.train.data.training_data import load_training_data, make_loader
from loongforge.train.model.build import build_model
from loongforge.train.model.noise import noise_for
from loongforge.train.recipes import plan_model


def model_and_inputs(root: str, recipe: str = "tiny", *, device="cuda", dtype=torch.float32, batch_size: int = 8,
                     seed: int = 0, **model_options):
    """(model on `device` in `dtype`, (inputs, noise, u)): the recipe's model and its first batch of `root`
    through the trainer's processor. `model_options`: train.config.ModelConfig fields (attention, ...)."""
    device = torch.device(device)
    data = DataConfig(root=root, num_workers=0)
    index = load_training_data(data)
    opts = {"dit_dropout": 0.0, **model_options}
    plan = plan_model(TrainConfig(recipe=recipe, data=data, run=RunConfig(run_dir=root),
                                  model=ModelConfig(**opts)), index)
    torch.manual_seed(seed)
    model = build_model(plan.model, attention=opts.get("attention", "auto")).to(device, dtype)
    p, r = plan.processor, index.roots[0]
    loader = make_loader(data, index, batch_size=batch_size, rank=0, world=1, device=device, processor=p,
                         prompts=plan.prompts[0], image_mean=p.cfg.image_mean, image_std=p.cfg.image_std)
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    meta = batch.pop("meta")
    b = batch["action"].shape[0]
    noise, u, crop = noise_for(seed, meta["epoch"], meta["sample_ids"],
                               (b, plan.model.action_horizon, plan.model.max_action_dim), device)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in p(batch, r.tag, r.cameras, crop).items()}
    return model, (inputs, noise, u)


def loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
