"""Sample semantics (train/data/samples.py): pure functions, tiny inputs."""

import numpy as np
import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.data.samples import DeltaSpec, SampleTable, action_rows, gather_actions, state_indices, \
    video_indices


def test_every_timestep_is_a_sample_and_locate_round_trips():
    table = SampleTable(np.array([3, 0, 5, 1]))
    assert table.num_samples == 9
    ep, t = table.locate(np.arange(9))
    assert list(zip(ep.tolist(), t.tolist())) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4),
                                                  (3, 0)]
    for i, (e, tt) in enumerate(zip(ep, t)):
        assert table.sample_id(int(e), int(tt)) == i
    with pytest.raises(IndexError):
        table.locate(9)


def test_stride_keeps_every_sth_timestep_including_a_short_tail():
    table = SampleTable(np.array([5, 4]), stride=2)
    ep, t = table.locate(np.arange(table.num_samples))
    assert list(zip(ep.tolist(), t.tolist())) == [(0, 0), (0, 2), (0, 4), (1, 0), (1, 2)]
    with pytest.raises(IndexError):
        table.sample_id(0, 1)


def test_video_history_is_clamped_into_the_episode_like_gr00t():
    spec = DeltaSpec(video=(-6, -4, -2, 0))
    assert video_indices(0, 10, spec).tolist() == [0, 0, 0, 0]
    assert video_indices(5, 10, spec).tolist() == [0, 1, 3, 5]
    assert video_indices(9, 10, spec).tolist() == [3, 5, 7, 9]
    assert state_indices(3, 10, spec).tolist() == [0, 0, 1, 3]  # default: state at the video offsets
    fut = DeltaSpec(video=(0, 2))
    assert video_indices(9, 10, fut).tolist() == [9, 9]  # past the end: the last frame


def test_actions_past_the_end_repeat_the_last_row_and_are_masked():
    actions = np.arange(10, dtype=np.float32).reshape(5, 2)
    spec = DeltaSpec(action_horizon=4)
    rows, valid = action_rows(3, 5, spec)
    assert rows.tolist() == [3, 4, 4, 4] and valid.tolist() == [True, True, False, False]
    chunk, valid = gather_actions(actions, 3, spec)
    np.testing.assert_array_equal(chunk, actions[[3, 4, 4, 4]])
    zero, _ = gather_actions(actions, 3, DeltaSpec(action_horizon=4, action_pad="zero"))
    np.testing.assert_array_equal(zero, np.r_[actions[[3, 4]], np.zeros((2, 2), np.float32)])
    chunk, valid = gather_actions(actions, 0, spec)
    assert valid.all() and chunk.tolist() == actions[:4].tolist()


def test_block_groups_follow_blocks_of_t():
    table = SampleTable(np.array([5, 3]))
    assert table.block_groups(2).tolist() == [0, 0, 1, 1, 2, 3, 3, 4]
    strided = SampleTable(np.array([5, 3]), stride=2)  # t = 0,2,4 | 0,2
    assert strided.block_groups(4).tolist() == [0, 0, 1, 2, 2]


def test_keep_mask_by_episode():
    table = SampleTable(np.array([2, 3]))
    assert table.keep_mask(np.array([False, True])).tolist() == [False, False, True, True, True]
    assert table.keep_mask(None) is None


@pytest.mark.parametrize("kw", [dict(video=()), dict(video=(0, -2)), dict(video=(0, 0)),
                                dict(video=(-1, 0), state=(0,)), dict(action_horizon=0),
                                dict(action_pad="mirror")])
def test_bad_specs_are_config_errors(kw):
    with pytest.raises(ConfigError):
        DeltaSpec(**kw)
