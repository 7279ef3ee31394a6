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
    p, r = plan.processor, index.roots[0]
    with BlockLoader(root, dataset=index.ds, batch_size=n, max_steps=1, prefetch=0, deltas=index.deltas,
                     prompts=plan.prompts[0], image_mean=p.cfg.image_mean, image_std=p.cfg.image_std,
                     state_action=p.state_action(r.tag), keys=r.keys, cameras=r.cameras) as loader:
        batch = next(iter(loader))
    meta = batch.pop("meta")
    b = batch["action"].shape[0]
    noise, u, crop = noise_for(0, 0, meta["sample_ids"], (b, plan.model.action_horizon, plan.model.max_action_dim),
                               torch.device("cpu"))
    return p(batch, r.tag, r.cameras, crop), noise, u, batch


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


def test_state_dropout_replaces_the_state_tokens_of_the_drawn_samples_in_training_only(train_root):
    """N1.6's state_dropout_prob: a learned `action_head.mask_token` (the reference's name) stands in for the
    state features of samples whose draw is below it; evaluation never drops; without it no mask token."""
    root, index = train_root
    assert "action_head.mask_token" not in dict(build_model(_plan(root, index).model).named_parameters())
    plan = _plan(root, index, dit_dropout=0.0, state_dropout=0.5)
    torch.manual_seed(0)
    model = build_model(plan.model)
    assert dict(model.named_parameters())["action_head.mask_token"].shape == (1, 1, plan.model.input_embedding_dim)
    inputs, noise, u, _ = _inputs(root, index, plan)
    b = noise.shape[0]
    seen = {}
    model.action_head.model.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0][:, 0].clone()))
    for name, drop in (("kept", torch.ones(b)), ("dropped", torch.zeros(b))):
        model(dict(inputs, state_dropout_u=drop), noise, u)
        seen[name] = seen["x"]
    token = model.action_head.mask_token[0, 0]
    assert torch.allclose(seen["dropped"], token.expand_as(seen["dropped"]))
    assert not torch.allclose(seen["kept"], token.expand_as(seen["kept"]))
    model.eval()
    model(dict(inputs, state_dropout_u=torch.zeros(b)), noise, u)
    assert torch.equal(seen["x"], seen["kept"])  # evaluation: the state tokens as they are


def test_dropout_masks_follow_the_sample_not_the_batch_it_rides_in(train_root):
    """kernels/dropout.py: with DiT dropout on, a sample's loss terms are the same whether it trains in a batch
    of 4 or in one of 2 (another rank layout, another micro-batch split); torch's own dropout is not."""
    from loongforge.train.kernels.dropout import apply_sample_dropout, sample_keys

    root, index = train_root
    plan = _plan(root, index, dit_dropout=0.3)
    inputs, noise, u, batch = _inputs(root, index, plan)
    ids = batch["sample_ids"].tolist()

    def per_sample(model, keys=None):
        def run(rows):
            sub = {k: (v[rows] if k != "pixel_values" else v.view(4, -1, *v.shape[1:])[rows].flatten(0, 1))
                   for k, v in inputs.items()}
            picked = list(range(4))[rows]
            if keys is not None:
                keys.set(sample_keys(0, 0, [ids[r] for r in picked]))
            torch.manual_seed(len(picked))  # torch's dropout: another draw per batch shape
            out = model.action_head.loss(model.encode(sub), sub["action"].float(), sub["action_mask"].float(),
                                         noise[rows], torch.full((len(picked),), 0.5), torch.tensor(1.0))
            return out["action_loss"].sum((1, 2))
        return run(slice(0, 4)), torch.cat([run(slice(0, 2)), run(slice(2, 4))])

    torch.manual_seed(0)
    model = build_model(plan.model).train()
    whole, split = per_sample(model)
    assert not torch.allclose(whole, split, rtol=1e-3), "torch's dropout drew the same masks: the test cannot tell"
    keys, swapped = apply_sample_dropout(model)
    assert swapped and all(".dropout" not in n or "model." in n for n in swapped)
    whole, split = per_sample(model, keys)
    torch.testing.assert_close(whole, split, rtol=1e-5, atol=1e-6)
    keys.set(None)
    model.eval()  # evaluation: no dropout at all
    torch.testing.assert_close(*per_sample(model), rtol=1e-5, atol=1e-6)
