"""The decode worker's body (train/data/fill.py) fills every row as samples.py and N1.6's processor
(state_action.py) define a sample, on every timestep of every episode: negative video deltas clamped
into the episode, state deltas of their own, action chunks running past the end ("last" and "zero"
padding), and per key sin/cos, min/max and mean/std state, a relative action key taken against its
state key with per-step statistics, an absolute one. The filler processes each episode once
(EpisodeRows); this checks it against the per-row reference (gather raw rows, then StateAction's
per-sample state/action) value for value."""

import numpy as np
import pytest

from loongforge.shared import embodiment as emb
from loongforge.shared.dataset import open_root
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.batch import BatchLayout, encode_text
from loongforge.train.data.fill import BlockFiller
from loongforge.train.data.samples import DeltaSpec, gather_actions, state_indices, video_indices
from loongforge.train.data.state_action import StateAction

LENGTHS = (9, 5, 12, 3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fill_root"))
    return path, make_synthetic_root(path, lengths=LENGTHS, height=8, width=8, block_size=4, state_dim=5,
                                     action_dim=3)


def processor(horizon: int) -> tuple[StateAction, dict]:
    """state a [0:2] sin/cos, b [2:4] min/max (dim 1: min == max -> 0), c [4:5] mean/std; action x [0:2]
    relative to state a (per-step statistics), y [2:3] absolute min/max."""
    m = emb.ModalityConfig
    config = emb.EmbodimentConfig(
        video=m((0,), ("front", "wrist")), state=m((0,), ("a", "b", "c"), ("a",), ("c",)),
        action=m(tuple(range(horizon)), ("x", "y"), action_configs=(emb.ActionConfig("RELATIVE", state_key="a"), emb.ActionConfig())),
        language=m((0,), ("annotation.human.action.task_description",)))
    rng = np.random.default_rng(0)

    def st(lo, hi, shape=None):
        lo = np.asarray(lo, np.float64) if shape is None else rng.normal(size=shape) - 1
        hi = np.asarray(hi, np.float64) if shape is None else lo + rng.uniform(0.5, 2, size=shape)
        return {"min": lo.tolist(), "max": hi.tolist(), "mean": ((lo + hi) / 2).tolist(),
                "std": ((hi - lo) / 3).tolist(), "q01": lo.tolist(), "q99": hi.tolist()}
    stats = {"state": {"a": st([-1, -1], [1, 1]), "b": st([-2, 0.5], [2, 0.5]), "c": st([-1], [3])},
             "action": {"x": st([-1, -1], [1, 1]), "y": st([-3], [3])},
             "relative_action": {"x": st(None, None, (horizon, 2))}}
    keys = {"state": {"a": emb.KeySlice("state", 0, 2), "b": emb.KeySlice("state", 2, 4),
                      "c": emb.KeySlice("state", 4, 5)},
            "action": {"x": emb.KeySlice("action", 0, 2), "y": emb.KeySlice("action", 2, 3)},
            "video": {"front": "front", "wrist": "wrist"}, "language": {"t": "task_index"}}
    return StateAction(config, stats, tag="test"), keys


@pytest.mark.parametrize("spec", [DeltaSpec(video=(-3, 0), action_horizon=4),
                                  DeltaSpec(video=(-2, 0), state=(-1, 0), action_horizon=6, action_pad="zero"),
                                  DeltaSpec(video=(-1, 0, 2), action_horizon=3),  # a future frame: clamped at the end
                                  DeltaSpec(video=(0,), action_horizon=16)])
@pytest.mark.parametrize("cache_bytes", [1 << 20, 800])  # 800: two 4-frame 8x8 blocks, evicted and reused
def test_every_row_equals_the_per_row_reference(root, spec, cache_bytes):
    path, written = root
    ds = open_root(path)
    sa, keys = processor(spec.action_horizon)
    layout = BatchLayout(1, ("front", "wrist"), 8, 8, spec.frames, sa.state_dim, 3, spec.action_horizon, 16,
                         raw_state_dim=5, raw_action_dim=3)
    filler = BlockFiller(ds, spec, layout, cache_bytes, None, sa, keys)
    arrays = layout.views(bytearray(layout.nbytes))
    for e, n in enumerate(LENGTHS):
        frames, raw = written[e]
        for t in range(n):
            bad, _ = filler.fill(arrays, [(0, e, t)], "raise")
            assert bad == 0
            for slot in ("front", "wrist"):
                np.testing.assert_array_equal(arrays[f"frames.{slot}"][0], frames[slot][video_indices(t, n, spec)])
            s = raw["state"][state_indices(t, n, spec)]
            state = {"a": s[:, 0:2], "b": s[:, 2:4], "c": s[:, 4:5]}
            np.testing.assert_array_equal(arrays["state"][0], sa.state(state))
            action, valid = gather_actions(raw["action"].copy(), t, spec)
            np.testing.assert_array_equal(arrays["action"][0], sa.action({"x": action[:, :2], "y": action[:, 2:]},
                                                                         state))
            np.testing.assert_array_equal(arrays["raw_state"][0], s)
            np.testing.assert_array_equal(arrays["raw_action"][0], action)
            np.testing.assert_array_equal(arrays["action_valid"][0], valid)
            ids, mask = encode_text(ds.info.tasks.get(str(int(raw["task_index"][t])), ""), 16)
            np.testing.assert_array_equal(arrays["task_tokens"][0], ids)
            np.testing.assert_array_equal(arrays["task_mask"][0], mask)
            assert arrays["frame_mask"][0].all() and arrays["sample_valid"][0]
    assert filler.counters()["samples"] == sum(LENGTHS) and filler.counters()["fill_cpu_s"] > 0
    assert (filler.cache.evictions > 0) == (cache_bytes < 1000)


def test_the_relative_key_is_the_chunk_minus_the_current_state_normalised_per_step(root):
    path, written = root
    sa, _ = processor(4)
    raw = written[0][1]
    t, h = 2, 4
    s = raw["state"][t:t + 1]
    got = sa.action({"x": raw["action"][t:t + h, :2], "y": raw["action"][t:t + h, 2:]},
                    {"a": s[:, 0:2], "b": s[:, 2:4], "c": s[:, 4:5]})
    p = sa.statistics["relative_action"]["x"]
    lo, hi = np.array(p["min"]), np.array(p["max"])
    rel = raw["action"][t:t + h, :2].astype(np.float64) - s[0, 0:2]
    np.testing.assert_allclose(got[:, :2], np.clip(2 * (rel - lo) / (hi - lo) - 1, -1, 1), atol=1e-6)


def test_an_episode_whose_arrays_disagree_with_the_layout_is_a_bad_sample_every_time(root):
    path, _ = root
    ds = open_root(path)
    spec = DeltaSpec(video=(0,), action_horizon=2)
    sa, keys = processor(2)
    keys = {**keys, "state": {**keys["state"], "c": emb.KeySlice("state", 4, 7)}}  # the root's state has 5 values
    layout = BatchLayout(2, ("front", "wrist"), 8, 8, 1, sa.state_dim, 3, 2, 16)
    filler = BlockFiller(ds, spec, layout, 1 << 20, None, sa, keys)
    arrays = layout.views(bytearray(layout.nbytes))
    for _ in range(2):  # not cached as good after the first failure
        bad, reasons = filler.fill(arrays, [(0, 0, 1), (1, 0, 2)], "skip")
        assert bad == 2 and "state key 'c' needs [4:7]" in reasons[0]
        assert not arrays["sample_valid"].any() and not arrays["frame_mask"].any()
