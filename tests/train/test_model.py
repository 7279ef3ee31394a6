import dataclasses

import pytest
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train import recipes
from loongforge.train.config import DataConfig, ModelConfig, ParallelConfig, RunConfig
from loongforge.train.loader import ShardLoader
from loongforge.train.model import VLAModel
from loongforge.train.trainer import noise_for


def _batch(root, index, **kw):
    with ShardLoader(root, batch_size=4, index=index, max_steps=1, prefetch=0, **kw) as loader:
        batch = next(iter(loader))
    batch.pop("meta")
    return batch


def test_tiny_forward_backward_and_learns(train_root):
    root, index = train_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2)
    torch.manual_seed(0)
    model = VLAModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = _batch(root, index)
    noise, t = noise_for(0, 0, 0, 0, batch["action"].shape, torch.device("cpu"))
    losses = []
    for _ in range(15):
        out = model(batch, noise, t)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]  # can fit one batch: every part of the graph gets gradient
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_padded_frames_do_not_change_the_loss(variable_root):
    root, index = variable_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=3)
    model = VLAModel(cfg).eval()
    batch = _batch(root, index, shuffle_window=1, seed=5)
    assert not batch["frame_mask"].all(), "fixture should contain a padded frame"
    noise, t = noise_for(0, 0, 0, 0, batch["action"].shape, torch.device("cpu"))
    base = model(batch, noise, t)["loss"]
    pad = ~batch["frame_mask"]
    for slot, fr in batch["frames"].items():
        fr[pad] = torch.randn_like(fr[pad]) * 100  # garbage in the padding
    batch["state"][pad] = 1e3
    assert torch.allclose(model(batch, noise, t)["loss"], base, atol=1e-5)


def test_1_6b_recipe_counts_params_on_meta():
    n = recipes.count_params_meta(recipes.large_1_6b())
    assert 1.5e9 < n < 1.7e9


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="model.dim"):
        ModelConfig(dim=30, heads=4)
    with pytest.raises(ConfigError, match="model.patch"):
        ModelConfig(patch=5, image_size=(16, 16))
    with pytest.raises(ConfigError, match="data.bad_samples"):
        DataConfig(root="x", bad_samples="ignore")
    with pytest.raises(ConfigError, match="parallel.zero_stage"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(ConfigError, match="run.profile_steps"):
        RunConfig(run_dir="r", profile_steps=(3, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dim = 8
    with pytest.raises(ConfigError, match="model.attention"):
        VLAModel(ModelConfig(attention="flash"))
