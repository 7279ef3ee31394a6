import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loongforge.preprocess.episode import EpisodeTable
from loongforge.preprocess.window import cut_samples, plan_windows


def windows(n, k=4, stride=4, step=1, h=3, m=2):
    return plan_windows(n, frames_per_sample=k, stride=stride, frame_step=step, action_horizon=h, min_frames=m)


def test_windows_keep_tail_down_to_min_frames():
    ws = windows(10)
    assert [w.start for w in ws] == [0, 4, 8]
    assert [w.rows for w in ws] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [len(windows(10, m=4))] == [2]  # min_frames = K drops the short tail


def test_actions_start_at_last_frame_and_pad_by_repeating():
    ws = windows(10, h=4)
    assert ws[0].action_rows == (3, 4, 5, 6) and ws[0].action_valid == 4
    assert ws[2].action_rows == (9, 9, 9, 9) and ws[2].action_valid == 1  # last frame: one real row
    assert windows(8, h=4)[1].action_rows == (7, 7, 7, 7)


def test_frame_step_spreads_frames():
    ws = windows(12, k=3, stride=5, step=2, m=1)
    assert [w.rows for w in ws] == [(0, 2, 4), (5, 7, 9), (10,)]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 6), stride=st.integers(1, 7), step=st.integers(1, 3),
       h=st.integers(1, 20), m=st.integers(1, 6))
def test_window_invariants(n, k, stride, step, h, m):
    m = min(m, k)
    ws = windows(n, k, stride, step, h, m)
    for w in ws:
        assert m <= len(w.rows) <= k and all(0 <= r < n for r in w.rows)
        assert list(w.rows) == list(range(w.start, w.start + step * len(w.rows), step))
        assert len(w.action_rows) == h and 1 <= w.action_valid <= h
        real = w.action_rows[: w.action_valid]
        assert list(real) == list(range(w.rows[-1], w.rows[-1] + w.action_valid))
        assert set(w.action_rows[w.action_valid :]) <= {real[-1]}
        if w.action_valid < h:
            assert real[-1] == n - 1  # padding only past the episode end
    # every window start that has at least m frames left is present
    expected = [s for s in range(0, n, stride) if min(k, (n - 1 - s) // step + 1) >= m]
    assert [w.start for w in ws] == expected


def test_cut_samples_maps_rows_to_content():
    n, h, w = 9, 4, 6
    table = EpisodeTable(episode=7, state=np.arange(n * 2, dtype=np.float32).reshape(n, 2),
                         action=-np.arange(n * 3, dtype=np.float32).reshape(n, 3),
                         timestamps=np.arange(n) / 10.0, frame_index=np.arange(n) + 100,
                         task_index=np.array([1] * 5 + [0] * 4), task_text={0: "zero", 1: "one"})
    video = np.arange(n, dtype=np.uint8)[:, None, None] * np.ones((1, h * 3 // 2, w), np.uint8)
    ws = windows(n, k=3, stride=3, h=2, m=1)
    samples = list(cut_samples(table, {"cam": video}, ws))
    assert [s.key for s in samples] == ["e000007_f000100", "e000007_f000103", "e000007_f000106"]
    s = samples[1]
    assert s.frame_indices.tolist() == [103, 104, 105]
    assert np.array_equal(s.state, table.state[3:6]) and np.array_equal(s.action, table.action[5:7])
    assert s.frames["cam"][:, 0, 0].tolist() == [3, 4, 5]
    assert (s.task, s.task_index) == ("one", 1)
    assert (samples[2].task, samples[2].action_valid) == ("zero", 1)  # last row is the final frame
