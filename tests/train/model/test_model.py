import dataclasses

import pytest
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train.model import recipes
from loongforge.train.config import DataConfig, ModelConfig, ParallelConfig, RunConfig
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.model.build import build_model
from loongforge.train.model.model import VLAModel, count_parameters
from loongforge.train.model.noise import noise_for


def _batch(root, index, frames: int = 2, **kw):
    """A real batch of 4 samples with `frames` frames per camera (video deltas -frames+1 .. 0)."""
    deltas = DeltaSpec(video=tuple(range(1 - frames, 1)), action_horizon=index.dataset.action_horizon)
    with BlockLoader(root, dataset=index.ds, batch_size=4, max_steps=1, prefetch=0, deltas=deltas, **kw) as loader:
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
    noise, t = noise_for(0, 0, range(batch["action"].shape[0]), batch["action"].shape, torch.device("cpu"))
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


def test_masked_frames_do_not_change_the_loss(train_root):
    """Frames whose frame_mask is False (a bad sample's, or padding a caller adds) are invisible to the model."""
    root, index = train_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=3)
    model = VLAModel(cfg).eval()
    batch = _batch(root, index, frames=3, seed=5)
    batch["frame_mask"] = torch.tensor([[True, True, True], [True, True, False], [True, False, False],
                                        [True, True, False]])
    noise, t = noise_for(0, 0, range(batch["action"].shape[0]), batch["action"].shape, torch.device("cpu"))
    base = model(batch, noise, t)["loss"]
    pad = ~batch["frame_mask"]
    for slot, fr in batch["frames"].items():
        fr[pad] = torch.randn_like(fr[pad]) * 100  # garbage in the padding
    batch["state"][pad] = 1e3
    assert torch.allclose(model(batch, noise, t)["loss"], base, atol=1e-5)


def test_1_6b_recipe_counts_params_on_meta():
    with torch.device("meta"):  # no weights allocated
        n = count_parameters(build_model(recipes.large_1_6b()))
    assert 1.5e9 < n < 1.7e9


def _logits_of(model, batch, noise, u):
    """The discrete head's logits as the training forward computes them (hook on its output layer)."""
    got = {}
    head = model.bin_out if hasattr(model, "bin_out") else model.bin_head  # bin_head: the seed's name
    hook = head.register_forward_hook(lambda m, i, o: got.__setitem__("logits", o))
    try:
        out = model(batch, noise, u)
    finally:
        hook.remove()
    return got["logits"].view(*batch["action"].shape[:2], -1), out["ce_loss"]


def test_discrete_head_never_sees_its_target_or_x_t(train_root):
    """Structural leakage check: logit i may depend on ground-truth actions < i only, never on x_t.
    (The seed's head read x_t-built action tokens with a self-inclusive causal mask: it fails here.)"""
    root, index = train_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2, action_horizon=6)
    torch.manual_seed(0)
    model = VLAModel(cfg).eval()
    batch = _batch(root, index)
    batch["action"] = torch.randn(4, 6, cfg.action_dim)
    batch["action_valid"] = torch.ones(4, 6, dtype=torch.bool)
    noise, u = torch.randn(4, 6, cfg.action_dim), torch.full((4,), 0.9)
    base, ce = _logits_of(model, batch, noise, u)
    # x_t alone (other noise, other time): the discrete loss does not move at all.
    for noise2, u2 in ((torch.randn_like(noise) * 5, u), (noise, torch.full((4,), 0.1))):
        logits, ce2 = _logits_of(model, batch, noise2, u2)
        assert torch.equal(logits, base) and torch.equal(ce2, ce)
    for i in range(6):
        pert = {**batch, "action": batch["action"].clone()}
        pert["action"][:, i] += 2.0  # moves both the target at i and x_t
        logits, _ = _logits_of(model, pert, noise, u)
        assert torch.equal(logits[:, : i + 1], base[:, : i + 1]), f"logits <= {i} saw action {i}"
        if i + 1 < 6:  # teacher forcing: position i + 1 does read action i (the test can fail)
            assert not torch.allclose(logits[:, i + 1], base[:, i + 1])


def _rows(batch, rows):
    return {k: ({s: f[rows] for s, f in v.items()} if isinstance(v, dict) else v[rows]) for k, v in batch.items()}


def test_inference_is_batched_and_deterministic(train_root):
    root, index = train_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2)
    torch.manual_seed(0)
    model = VLAModel(cfg).eval()
    batch = _batch(root, index)
    a = model.predict_action(batch, steps=4, seed=3)
    assert a.shape == batch["action"].shape and not a.requires_grad
    assert torch.equal(a, model.predict_action(batch, steps=4, seed=3))
    assert not torch.equal(a, model.predict_action(batch, steps=4, seed=4))
    d = model.predict_discrete(batch)
    assert d.shape == batch["action"].shape
    torch.testing.assert_close(model.predict_discrete(_rows(batch, slice(1, 3))), d[1:3])
    # Euler steps integrate the velocity: with 1 step the result is noise + v(noise, t=0).
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(a.shape, generator=g)
    with torch.inference_mode():
        vl, valid = model.encode(batch)
        v = model.velocity(vl, valid, model.current_state(batch), x0, torch.zeros(4))
    torch.testing.assert_close(model.predict_action(batch, steps=1, seed=3), x0 + v)


def test_beta_time_schedule_matches_groot():
    from loongforge.train.model.layers import flow_time

    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    t = flow_time(u, "beta")
    s = 0.999 * (1 - t)  # GR00T: t = (0.999 - s) / 0.999 with s ~ Beta(1.5, 1): E[s] = 0.6
    assert abs(s.mean().item() - 0.6) < 0.005
    assert (t < 0.5).float().mean() > 0.6  # the noisy half is favoured
    assert torch.equal(flow_time(u, "uniform"), u)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="model.dim"):
        ModelConfig(dim=30, heads=4)
    with pytest.raises(ConfigError, match="model.vision_tokens"):
        ModelConfig(vision_tokens=12)
    with pytest.raises(ConfigError, match="model.time_schedule"):
        ModelConfig(time_schedule="logit-normal")
    with pytest.raises(ConfigError, match="data.bad_samples"):
        DataConfig(root="x", bad_samples="ignore")
    with pytest.raises(ConfigError, match="parallel.zero_stage"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(ConfigError, match="run.profile_steps"):
        RunConfig(run_dir="r", profile_steps=(3, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dim = 8
    with pytest.raises(ConfigError, match="model.attention"):
        ModelConfig(attention="cudnn")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inference_on_cuda_matches_cpu_and_is_deterministic(train_root):
    root, index = train_root
    cfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2)
    torch.manual_seed(0)
    model = VLAModel(cfg).eval()
    batch = _batch(root, index)
    want = model.predict_discrete(batch)
    gpu = model.to("cuda")
    dev = {k: ({s: f.cuda() for s, f in v.items()} if isinstance(v, dict) else v.cuda()) for k, v in batch.items()}
    a = gpu.predict_action(dev, steps=4, seed=7)
    assert torch.equal(a, gpu.predict_action(dev, steps=4, seed=7)) and a.device.type == "cuda"
    torch.testing.assert_close(gpu.predict_discrete(dev).cpu(), want, atol=2 * 6.0 / 31, rtol=0)
    out = gpu.to(torch.bfloat16)(dev, torch.randn(a.shape, device="cuda"), torch.rand(a.shape[0], device="cuda"))
    assert torch.isfinite(out["loss"])
