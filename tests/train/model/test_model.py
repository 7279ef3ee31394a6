"""GR00T N1.6 as LoongForge builds and trains it: a real batch through the processor trains, the
tune switches freeze what N1.6 freezes (and keep frozen parts out of dropout), inference is batched and
deterministic, the flow time is N1.6's Beta(1.5, 1), the recipes are N1.6 at three sizes, and a bad
config names its field. Numerics against Isaac-GR00T's own outputs: test_gr00t_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.processor import Processor
from loongforge.train.model.action_head import flow_time
from loongforge.train.model.build import build_model
from loongforge.train.model.config import GrootConfig
from loongforge.train.model.model import Gr00tN1d6, count_parameters
from loongforge.train.model.noise import noise_for
from loongforge.train.recipes import RECIPES, plan_model


def _plan(root, index, **model):
    return plan_model(TrainConfig(data=DataConfig(root=root), run=RunConfig(run_dir=root),
                                  model=ModelConfig(**model)), index)


def _inputs(root, index, plan, n=4):
    """A real batch of `n` samples from the loader, through the run's processor (training crops)."""
    p = plan.processor
    with BlockLoader(root, dataset=index.ds, batch_size=n, max_steps=1, prefetch=0, deltas=index.deltas,
                     prompts=plan.prompts, image_mean=p.image_mean, image_std=p.image_std) as loader:
        batch = next(iter(loader))
    meta = batch.pop("meta")
    b, h, _ = batch["action"].shape
    noise, u, crop = noise_for(0, 0, meta["sample_ids"], (b, h, plan.model.max_action_dim), torch.device("cpu"))
    proc = Processor(p, max_state_dim=plan.model.max_state_dim, max_action_dim=plan.model.max_action_dim,
                     embodiment_id=plan.embodiment_id)
    return proc(batch, crop), noise, u, batch


def test_tiny_trains_on_a_real_batch(train_root):
    root, index = train_root
    plan = _plan(root, index, dit_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(plan.model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, noise, u, _ = _inputs(root, index, plan)
    assert inputs["pixel_values"].shape == (4 * 2, 3, 56, 56)  # 2 cameras, N1.6's transform at edge 56
    assert int((inputs["input_ids"] == plan.model.image_token_index).sum()) == 4 * 2 * 4
    losses = []
    for _ in range(15):
        out = model(inputs, noise, u)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert np.isfinite(losses).all() and losses[-1] < 0.65 * losses[0], losses


def test_tune_switches_freeze_what_n16_freezes():
    cfg = GrootConfig().replace(tune_llm=False, tune_visual=False, tune_top_llm_layers=4)
    with torch.device("meta"):
        model = Gr00tN1d6(cfg)
    trains = {n.split(".layers.")[0] if ".layers." in n else n for n, p in model.named_parameters() if p.requires_grad}
    assert not any("vision_model" in n or "mlp1" in n for n in trains)
    llm = [n for n, p in model.named_parameters() if "language_model" in n and p.requires_grad]
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in llm} == {12, 13, 14, 15}  # the top 4 of 16
    assert not any("embed_tokens" in n or n.endswith("model.norm.weight") for n in llm)
    with torch.device("meta"):
        frozen_dit = Gr00tN1d6(cfg.replace(tune_diffusion_model=False, tune_projector=False))
    assert not any(p.requires_grad for p in frozen_dit.action_head.model.parameters())
    assert not any(p.requires_grad for p in frozen_dit.action_head.action_encoder.parameters())
    frozen_dit.train()
    assert not frozen_dit.action_head.model.training and frozen_dit.action_head.vlln.training  # no dropout there
    assert not frozen_dit.backbone.model.language_model.training


def test_get_action_is_batched_and_deterministic(train_root):
    root, index = train_root
    plan = _plan(root, index)
    torch.manual_seed(0)
    model = build_model(plan.model).eval()
    inputs, noise, _, _ = _inputs(root, index, plan)
    inputs = {k: v for k, v in inputs.items() if k not in ("action", "action_mask")}
    a = model.get_action(inputs, noise)
    b = model.get_action(inputs, noise)
    assert torch.equal(a, b) and a.shape == noise.shape
    one = model.get_action({k: (v[:2] if k == "pixel_values" else v[:1]) for k, v in inputs.items()}, noise[:1])
    torch.testing.assert_close(one, a[:1], atol=1e-5, rtol=1e-5)  # a sample alone = in a batch


def test_flow_time_is_n16_beta():
    """t = (1 - s) * 0.999 with s ~ Beta(1.5, 1): the inverse CDF of the caller's uniform u matches
    torch's Beta sampler in distribution (quantiles of 200k draws)."""
    cfg = GrootConfig()
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    t = flow_time(u, cfg)
    ref = (1 - torch.distributions.Beta(1.5, 1.0).sample((200_000,))) * 0.999
    qs = torch.linspace(0.05, 0.95, 10)
    torch.testing.assert_close(torch.quantile(t, qs), torch.quantile(ref, qs), atol=5e-3, rtol=0)
    assert float(t.max()) <= 0.999 and float(t.min()) >= 0.0


def test_recipes_are_n16_at_three_sizes():
    counts = {}
    for name, make in RECIPES.items():
        with torch.device("meta"):
            model = Gr00tN1d6(make().model)
        counts[name] = count_parameters(model)
        assert [n for n, _ in model.named_parameters()][0].startswith("backbone.model.vision_model.vision_model.")
    assert counts["gr00t-n1.6"] == 2_964_610_912
    assert counts["tiny"] < counts["small"] < counts["gr00t-n1.6"]


def test_config_errors_name_the_field(train_root):
    with pytest.raises(ConfigError, match="model.backbone_embedding_dim"):
        GrootConfig(backbone_embedding_dim=1024)
    with pytest.raises(ConfigError, match="model.text.num_attention_heads"):
        GrootConfig().replace(text={"num_key_value_heads": 5})
    root, index = train_root
    with pytest.raises(ConfigError, match="--embodiment-tag"):
        _plan(root, index, embodiment_tag="a_robot_nobody_registered")
    with pytest.raises(ConfigError, match="recipe"):
        plan_model(TrainConfig(recipe="1.6b", data=DataConfig(root=root), run=RunConfig(run_dir=root)), index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_action_on_cuda_matches_cpu(train_root):
    root, index = train_root
    plan = _plan(root, index, attention="sdpa")
    torch.manual_seed(0)
    model = build_model(plan.model, "sdpa").eval()
    inputs, noise, _, _ = _inputs(root, index, plan)
    inputs = {k: v for k, v in inputs.items() if k not in ("action", "action_mask")}
    want = model.get_action(inputs, noise)
    got = model.cuda().get_action({k: v.cuda() for k, v in inputs.items()}, noise.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
