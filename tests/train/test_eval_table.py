"""The eval table's parts on hand-made data: the ridge-from-state baseline and the discrete-valued
groups (fitted from training-episode arrays), the policy variants per chunk (1 sample, K-sample
mean, snapped), the table and the per-group plot. Narrow fakes of the
model and the episode store: the arithmetic is what is checked; the real run is in
test_train_split_eval.py and test_fit.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loongforge.shared.errors import ConfigError, UsageError
from loongforge.train.data.batch import Norm
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.eval.baselines import DEFAULT_DISCRETE_MODE, MAX_LEVELS, fit_reference, group_modes
from loongforge.train.eval.openloop import check_request, errors, evaluate_episode, format_table
from loongforge.train.eval.plots import plot_episode, worst_dims
from loongforge.train.eval.policy import Policy

GROUPS = {"arm": (0, 2), "hand": (2, 3)}


def _data(episodes, *, val=(), modality=None, horizon=2):
    """A TrainingData stand-in: per-episode state/action arrays, N1.6's min/max normalisation over the
    training episodes (as preprocess records it)."""
    ds = SimpleNamespace(val_mask=np.array([i in val for i in range(len(episodes))]),
                         read_arrays=lambda r: episodes[r])
    train = [e for i, e in enumerate(episodes) if i not in val]
    stats = {k: {"min": np.concatenate([e[k] for e in train]).min(0).tolist(),
                 "max": np.concatenate([e[k] for e in train]).max(0).tolist()} for k in ("state", "action")}
    info = SimpleNamespace(stats=stats, state_dim=episodes[0]["state"].shape[1],
                           action_dim=episodes[0]["action"].shape[1], modality=modality or {})
    return SimpleNamespace(ds=ds, dataset=info, deltas=DeltaSpec(action_horizon=horizon))


def _episode(rng, n=40):
    state = rng.normal(size=(n, 3)).astype(np.float32)
    arm = state[:, :2] @ np.array([[1.0, 0.5], [-0.3, 2.0]], np.float32) + 0.25
    hand = np.where(state[:, 2:3] > 0, 1.5, -1.5).astype(np.float32)  # a binary command
    return {"state": state, "action": np.concatenate([arm, hand], 1)}


def test_ridge_recovers_a_linear_state_to_action_map_and_finds_the_binary_group():
    rng = np.random.default_rng(0)
    eps = [_episode(rng) for _ in range(4)]
    # a held-out episode whose actions break the map: it must not enter the fit
    eps.append({"state": eps[0]["state"], "action": eps[0]["action"] + 100.0})
    data = _data(eps, val=(4,))
    ref = fit_reference(data, GROUPS)
    assert ref.samples == 4 * 40 and ref.discrete_groups == ("hand",)
    assert ref.levels[2].tolist() == [-1.5, 1.5] and 0 not in ref.levels
    state = eps[1]["state"][:5]
    norm = Norm.from_dataset(data.dataset)  # the ridge works in normalised units, as the model does
    chunk = norm.unaction(ref.ridge(norm.state(state)))  # (5, H=2, 3): row 0 of the chunk is the action at t
    np.testing.assert_allclose(chunk[:, 0, :2], eps[1]["action"][:5, :2], atol=0.05)  # ridge's shrinkage
    assert ref.snap(np.array([[0.3, 0.3, 0.2], [0.0, 0.0, -9.0]]), [2])[:, 2].tolist() == [1.5, -1.5]


def test_modality_json_declares_a_group_discrete_or_continuous():
    rng = np.random.default_rng(1)
    eps = [_episode(rng)]
    forced = {"action": {"arm": {"start": 0, "end": 2, "discrete": True}, "hand": {"discrete": False}}}
    assert fit_reference(_data(eps, modality=forced), GROUPS).discrete_groups == ("arm",)
    many = [{"state": e["state"], "action": np.round(e["action"] * 2) / 2} for e in eps]  # > MAX_LEVELS values
    assert len(np.unique(many[0]["action"][:, 0])) > MAX_LEVELS
    assert fit_reference(_data(many), GROUPS).discrete_groups == ("hand",)


def _sample(batch, steps, seed):
    """A policy's one flow sample in dataset units: the seed (so the K-sample mean is the mean of the seeds)."""
    return np.full(batch["action"].shape, float(seed), np.float32)


def test_every_variant_per_chunk():
    rng = np.random.default_rng(2)
    ref = fit_reference(_data([_episode(rng) for _ in range(3)]), GROUPS)
    actions = torch.tensor(rng.normal(size=(2, 2, 3)), dtype=torch.float32)
    batch = {"action": actions, "action_valid": torch.ones(2, 2, dtype=torch.bool),
             "state": torch.tensor(rng.normal(size=(2, 1, 3)), dtype=torch.float32),
             "frame_mask": torch.ones(2, 1, dtype=torch.bool)}
    norm = SimpleNamespace(unaction=lambda a: np.asarray(a, np.float32))  # batches already in dataset units
    policy = SimpleNamespace(norm=norm, sample=_sample, unnormalize=lambda a: np.asarray(a, np.float32),
                             index=SimpleNamespace(dataset=SimpleNamespace(action_dim=3)))
    traj = evaluate_episode(policy, SimpleNamespace(batches=[batch]), seed=3, samples=4, ref=ref, discrete_dims=[2])
    assert np.all(traj["policy"] == 3.0) and np.all(traj["policy_k"] == 4.5)  # mean of seeds 3..6
    assert np.all(traj["snap"][:, :2] == 4.5) and np.all(traj["snap"][:, 2] == 1.5)  # the K-mean, hand snapped
    want = ref.ridge(batch["state"][:, -1].numpy()).reshape(-1, 3)
    np.testing.assert_allclose(traj["ridge"], want, rtol=1e-6)
    table = format_table({"overall": errors(traj, GROUPS), "discrete_groups": ["hand"], "samples": 4})
    head, arm, hand = table.splitlines()[:3]
    assert head.split() == ["MSE", "1", "sample", "4-mean", "snap", "ridge", "mean", "repeat-last"]
    assert arm.startswith("arm ") and hand.startswith("hand *") and "discrete-valued" in table
    assert "default: the 4-sample mean" in table


def test_plot_shows_the_worst_dims_labelled_by_group(tmp_path):
    truth = np.zeros((10, 3), np.float32)
    policy = truth.copy()
    policy[:, 2] = 3.0  # all the error is in the hand
    policy[:, 0] = 0.1
    traj = {"truth": truth, "policy": policy, "repeat_last": truth, "ridge": truth}
    assert worst_dims(traj, GROUPS, 1) == [(2, "hand[0]")]
    assert worst_dims(traj, GROUPS, 2) == [(0, "arm[0]"), (2, "hand[0]")]
    path = tmp_path / "ep.png"
    labels = plot_episode(traj, GROUPS, errors(traj, GROUPS), str(path), "episode 0", max_dims=2)
    assert labels == ["arm[0]", "hand[0]"] and path.stat().st_size > 1000


def test_plot_headlines_the_default_prediction_and_keeps_its_legend_off_the_data():
    """The titles gave the 1-sample MSE (arm 0.316, worse than the mean baseline) while the console says
    the default is the 8-sample mean, and a 6-pt legend sat on the first panel's data. Now the title is
    the K-sample mean's MSE beside the mean baseline's, and the legend, readable, is beside the panels."""
    from loongforge.train.eval.plots import LEGEND_PT, episode_figure

    rng = np.random.default_rng(0)
    truth = rng.normal(size=(30, 3)).astype(np.float32)
    traj = {"truth": truth, "policy": truth + rng.normal(scale=0.6, size=truth.shape).astype(np.float32),
            "policy_k": truth + 0.05, "mean": np.zeros_like(truth), "ridge": truth * 0.5, "repeat_last": truth}
    errs = errors(traj, GROUPS)
    fig, _ = episode_figure(traj, GROUPS, errs, "episode 3", max_dims=3, samples=8)
    title = fig._suptitle.get_text()
    assert f"policy (8-sample mean) MSE: arm {errs['policy_k']['mse']['arm']:.3g}" in title, title
    assert f"mean baseline: arm {errs['mean']['mse']['arm']:.3g}" in title and f"{errs['policy']['mse']['arm']:.3g}" \
        not in title, title
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert all(not box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    assert LEGEND_PT >= 8 and all(t.get_fontsize() == LEGEND_PT for t in legend.get_texts())
    assert "policy (8-sample mean)" in [t.get_text() for t in legend.get_texts()]


@pytest.mark.parametrize("samples", [0, -2])
def test_samples_below_one_is_a_usage_error(samples):
    with pytest.raises(UsageError, match="--samples"):
        check_request(SimpleNamespace(tables={"episode_id": np.arange(3)}), None, 4, samples)


def test_policy_takes_each_discrete_group_as_its_mode_asks():
    rng = np.random.default_rng(3)
    ref = fit_reference(_data([_episode(rng)]), GROUPS)
    assert group_modes(ref, None) == {"hand": DEFAULT_DISCRETE_MODE} and group_modes(ref, "snap") == {"hand": "snap"}
    with pytest.raises(ConfigError, match="not a discrete-valued group"):
        group_modes(ref, {"arm": "snap"})
    with pytest.raises(ConfigError, match="use one of"):
        group_modes(ref, {"hand": "vote"})
    index = SimpleNamespace(dataset=SimpleNamespace(modality={"action": {"arm": {"start": 0, "end": 2},
                                                                         "hand": {"start": 2, "end": 3}}},
                                                    action_dim=3))
    me = SimpleNamespace(reference=ref, index=index)
    flow = np.full((1, 2, 3), 0.4, np.float32)
    assert Policy.apply_modes(me, flow, "flow").tolist() == flow.tolist()
    snapped = Policy.apply_modes(me, flow, "snap")
    assert np.all(snapped[..., :2] == np.float32(0.4)) and np.all(snapped[..., 2] == 1.5)
    with pytest.raises(ConfigError, match="use one of"):
        group_modes(ref, {"hand": "head"})  # no discrete head in N1.6
