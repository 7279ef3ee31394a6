"""The decode worker's body (train/data/fill.py) fills every row as samples.py and batch.Norm define a
sample, on every timestep of every episode: negative video deltas clamped into the episode, state
deltas of their own, action chunks running past the end ("last" and "zero" padding), min/max
normalisation. The filler slices episodes normalized once; this checks it against the per-row
reference (gather, then normalize) value for value."""

import numpy as np
import pytest

from loongforge.shared.dataset import open_root
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.batch import BatchLayout, Norm, encode_text
from loongforge.train.data.fill import BlockFiller
from loongforge.train.data.samples import DeltaSpec, gather_actions, state_indices, video_indices

LENGTHS = (9, 5, 12, 3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fill_root"))
    return path, make_synthetic_root(path, lengths=LENGTHS, height=8, width=8, block_size=4, state_dim=5,
                                     action_dim=3)


@pytest.mark.parametrize("spec", [DeltaSpec(video=(-3, 0), action_horizon=4),
                                  DeltaSpec(video=(-2, 0), state=(-1, 0), action_horizon=6, action_pad="zero"),
                                  DeltaSpec(video=(-1, 0, 2), action_horizon=3),  # a future frame: clamped at the end
                                  DeltaSpec(video=(0,), action_horizon=16)])
@pytest.mark.parametrize("cache_bytes", [1 << 20, 800])  # 800: two 4-frame 8x8 blocks, evicted and reused
def test_every_row_equals_the_per_row_reference(root, spec, cache_bytes):
    path, written = root
    ds = open_root(path)
    rng = np.random.default_rng(0)
    norm = Norm(rng.normal(size=5).astype(np.float32) - 2, rng.normal(size=5).astype(np.float32) + 2,
                np.array([-1, 0, 3], np.float32), np.array([1, 0, 5], np.float32))  # dim 1: min == max -> 0
    layout = BatchLayout(1, ("front", "wrist"), 8, 8, spec.frames, 5, 3, spec.action_horizon, 16)
    filler = BlockFiller(ds, spec, layout, cache_bytes)
    filler.norm = norm  # before any episode is read: its arrays are normalized with this one
    arrays = layout.views(bytearray(layout.nbytes))
    for e, n in enumerate(LENGTHS):
        frames, raw = written[e]
        for t in range(n):
            bad, _ = filler.fill(arrays, [(0, e, t)], "raise")
            assert bad == 0
            for slot in ("front", "wrist"):
                np.testing.assert_array_equal(arrays[f"frames.{slot}"][0], frames[slot][video_indices(t, n, spec)])
            np.testing.assert_array_equal(arrays["state"][0], norm.state(raw["state"][state_indices(t, n, spec)]))
            action, valid = gather_actions(raw["action"].copy(), t, spec)
            np.testing.assert_array_equal(arrays["action"][0], norm.action(action))
            np.testing.assert_array_equal(arrays["action_valid"][0], valid)
            ids, mask = encode_text(ds.info.tasks.get(str(int(raw["task_index"][t])), ""), 16)
            np.testing.assert_array_equal(arrays["task_tokens"][0], ids)
            np.testing.assert_array_equal(arrays["task_mask"][0], mask)
            assert arrays["frame_mask"][0].all() and arrays["sample_valid"][0]
    assert filler.counters()["samples"] == sum(LENGTHS) and filler.counters()["fill_cpu_s"] > 0
    assert (filler.cache.evictions > 0) == (cache_bytes < 1000)


def test_an_episode_whose_arrays_disagree_with_the_index_is_a_bad_sample_every_time(root):
    path, _ = root
    ds = open_root(path)
    spec = DeltaSpec(video=(0,), action_horizon=2)
    layout = BatchLayout(2, ("front", "wrist"), 8, 8, 1, 7, 3, 2, 16)  # state_dim 7: the root has 5
    filler = BlockFiller(ds, spec, layout, 1 << 20)
    arrays = layout.views(bytearray(layout.nbytes))
    for _ in range(2):  # not cached as good after the first failure
        bad, reasons = filler.fill(arrays, [(0, 0, 1), (1, 0, 2)], "skip")
        assert bad == 2 and "do not match the index dims" in reasons[0]
        assert not arrays["sample_valid"].any() and not arrays["frame_mask"].any()
