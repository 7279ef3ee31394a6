"""The eval table's parts on hand-made data: the ridge-from-state baseline and the discrete-valued
groups (fitted from training-episode arrays), the policy variants per chunk (1 sample, K-sample
mean, snapped), the table and the per-group plot. Narrow fakes of the
model and the episode store: the arithmetic is what is checked; the real run is in
test_train_split_eval.py and test_fit.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loongforge.shared import embodiment as emb
from loongforge.shared.errors import ConfigError, UsageError
from loongforge.shared.statistics import feature_stats
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.data.state_action import StateAction
from loongforge.train.eval.baselines import DEFAULT_DISCRETE_MODE, MAX_LEVELS, fit_reference, group_modes
from loongforge.train.eval.openloop import check_request, errors, evaluate_episode, format_table
from loongforge.train.eval.plots import plot_episode, worst_dims
from loongforge.train.eval.policy import Policy

GROUPS = {"arm": (0, 2), "hand": (2, 3)}


def _data(episodes, *, val=(), modality=None, horizon=2):
    """A TrainingData stand-in and its processor: per-episode state/action arrays, one state key and the
    action keys arm / hand (absolute, min/max), statistics of the training episodes (as preprocess takes
    them). Samples: every t whose chunk lies in the episode (N1.6)."""
    ds = SimpleNamespace(val_mask=np.array([i in val for i in range(len(episodes))]),
                         read_arrays=lambda r: episodes[r], episode_lengths=np.array([len(e["state"]) for e in episodes]))
    train = [e for i, e in enumerate(episodes) if i not in val]
    m = emb.ModalityConfig
    config = emb.EmbodimentConfig(video=m((0,), ("front",)), state=m((0,), ("state",)),
                                  action=m(tuple(range(horizon)), ("arm", "hand")), language=m((0,), ("t",)))
    state = feature_stats(np.concatenate([e["state"] for e in train]))
    action = feature_stats(np.concatenate([e["action"] for e in train]))
    stats = {"state": {"state": state},
             "action": {k: {s: v[a:b] for s, v in action.items()} for k, (a, b) in GROUPS.items()}}
    keys = {"state": {"state": emb.KeySlice("state", 0, 3)},
            "action": {k: emb.KeySlice("action", a, b) for k, (a, b) in GROUPS.items()}}
    sa = StateAction(config, stats)
    info = SimpleNamespace(modality=modality or {})
    root = SimpleNamespace(tag="new_embodiment", config=config, keys=keys, deltas=DeltaSpec(action_horizon=horizon,
                                                                                           action_pad="none"))
    data = SimpleNamespace(ds=ds, dataset=info, deltas=root.deltas, roots=(root,))
    return data, SimpleNamespace(state_action=lambda tag: sa)


def _fit(episodes, **kw):
    data, proc = _data(episodes, **kw)
    return fit_reference(data, GROUPS, proc)


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
    data, proc = _data(eps, val=(4,))
    ref = fit_reference(data, GROUPS, proc)
    assert ref.samples == 4 * 39 and ref.discrete_groups == ("hand",)  # 40 - H + 1 samples an episode
    assert ref.levels[2].tolist() == [-1.5, 1.5] and 0 not in ref.levels
    state = eps[1]["state"][:5]
    sa = proc.state_action("new_embodiment")  # the ridge works in the model's units, as the model does
    out = sa.decode(ref.ridge(sa.state({"state": state[:, None]})[:, 0]), {"state": state[:, None]})
    chunk = sa.concat(out)  # (5, H=2, 3): row 0 of the chunk is the action at t
    np.testing.assert_allclose(chunk[:, 0, :2], eps[1]["action"][:5, :2], atol=0.05)  # ridge's shrinkage
    assert ref.snap(np.array([[0.3, 0.3, 0.2], [0.0, 0.0, -9.0]]), [2])[:, 2].tolist() == [1.5, -1.5]


def test_modality_json_declares_a_group_discrete_or_continuous():
    rng = np.random.default_rng(1)
    eps = [_episode(rng)]
    forced = {"action": {"arm": {"start": 0, "end": 2, "discrete": True}, "hand": {"discrete": False}}}
    assert _fit(eps, modality=forced).discrete_groups == ("arm",)
    many = [{"state": e["state"], "action": np.round(e["action"] * 2) / 2} for e in eps]  # > MAX_LEVELS values
    assert len(np.unique(many[0]["action"][:, 0])) > MAX_LEVELS
    assert _fit(many).discrete_groups == ("hand",)


def _flows(batch, tag, cameras, steps, seed, samples):
    """A policy's flow samples (decoding is the identity here): sample j is the seed seed + j everywhere
    (so the K-sample mean is the mean of the seeds)."""
    return np.stack([np.full(batch["action"].shape, float(seed + j), np.float32) for j in range(samples)])


def test_every_variant_per_chunk():
    rng = np.random.default_rng(2)
    ref = _fit([_episode(rng) for _ in range(3)])
    actions = torch.tensor(rng.normal(size=(2, 2, 3)), dtype=torch.float32)
    batch = {"action": actions, "action_valid": torch.ones(2, 2, dtype=torch.bool), "raw_action": actions,
             "state": torch.tensor(rng.normal(size=(2, 1, 3)), dtype=torch.float32),
             "raw_state": torch.zeros(2, 1, 3), "frame_mask": torch.ones(2, 1, dtype=torch.bool)}
    # batches already in dataset units: decoding is the identity
    processor = SimpleNamespace(state_action=lambda tag: SimpleNamespace(action_dim=3))
    policy = SimpleNamespace(flows=_flows, decode_concat=lambda a, raw, tag=None: np.asarray(a, np.float32),
                             processor=processor)
    valset = SimpleNamespace(batches=[batch], tag="new_embodiment", cameras=("front",))
    traj = evaluate_episode(policy, valset, seed=3, samples=4, ref=ref, discrete_dims=[2])
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
    ref = _fit([_episode(rng)])
    assert group_modes(ref, None) == {"hand": DEFAULT_DISCRETE_MODE} and group_modes(ref, "snap") == {"hand": "snap"}
    with pytest.raises(ConfigError, match="not a discrete-valued group"):
        group_modes(ref, {"arm": "snap"})
    with pytest.raises(ConfigError, match="use one of"):
        group_modes(ref, {"hand": "vote"})
    index = _data([_episode(rng)])[0]
    me = SimpleNamespace(reference=ref, index=index)
    flow = np.full((1, 2, 3), 0.4, np.float32)
    assert Policy.apply_modes(me, flow, "flow").tolist() == flow.tolist()
    snapped = Policy.apply_modes(me, flow, "snap")
    assert np.all(snapped[..., :2] == np.float32(0.4)) and np.all(snapped[..., 2] == 1.5)
    with pytest.raises(ConfigError, match="use one of"):
        group_modes(ref, {"hand": "head"})  # no discrete head in N1.6
