"""The baseline loader decodes what a full sequential decode decodes, reads the
right parquet rows, and fails loudly on broken input."""

from __future__ import annotations

import numpy as np
import pytest

from loongforge.benchmarks.loader.baseline import (LeRobotVideoDataset, Window, decode_frames_pyav, decode_span, make_baseline_loader,
                                            torchcodec_status)
from loongforge.shared.errors import ConfigError, SourceDataError

CAM = "observation.images.ego_view"


@pytest.mark.parametrize("frames", [(0, 1, 2, 3), (96, 98, 100, 102), (120, 121, 122, 123), (5, 50, 99, 149)])
def test_pyav_seek_decode_matches_sequential_decode(lerobot_root, decode_all, frames):
    # Windows inside the first GOP, across the keyframe at 100, inside the second
    # GOP (needs the seek to land on 100, not 0), and sparse.
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, frames[-1], frames)], action_horizon=4)
    path = ds.video_file(0, CAM)
    truth = decode_all(path)[list(frames)]
    got = decode_frames_pyav(path, [f / ds.fps for f in frames], ds.tolerance_s)
    np.testing.assert_array_equal(got, truth)


@pytest.mark.parametrize("frames", [(0, 1, 2, 3), (96, 98, 100, 102), (120, 121, 122, 123)])
def test_threaded_pyav_decodes_the_same_frames(lerobot_root, decode_all, frames):
    # The second baseline (thread_type="AUTO"): FFmpeg's frame threads must not change what a window holds.
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, frames[-1], frames)], action_horizon=4, backend="pyav-threaded")
    path = ds.video_file(0, CAM)
    np.testing.assert_array_equal(ds.decode(0, CAM, [f / ds.fps for f in frames]), decode_all(path)[list(frames)])


def test_the_same_dataset_at_another_gop_has_the_same_episodes_and_pixels(lerobot_root, decode_all, tmp_path):
    # P1's GOP axis regenerates the dataset per GOP; only the keyframe spacing may change.
    from loongforge.benchmarks.harness.data import generate_gops
    from loongforge.benchmarks.harness.config import BenchConfig
    from loongforge.benchmarks.loader.p1_rows import decoded_per_window

    cfg = BenchConfig(episodes=2, episode_frames=(150, 160), height=32, width=32, gop=100, gops=(2, 100), seed=3)
    roots = generate_gops(cfg, tmp_path, lerobot_root)
    assert set(roots) == {2, 100} and roots[100] == str(lerobot_root)
    short = LeRobotVideoDataset(roots[2], [Window(0, 0, (0,))], action_horizon=4)
    long_ = LeRobotVideoDataset(lerobot_root, [Window(0, 0, (0,))], action_horizon=4)
    a, b = decode_all(short.video_file(0, CAM)), decode_all(long_.video_file(0, CAM))
    assert a.shape == b.shape
    # Same source pixels: frame 0 is a keyframe in both encodings (later frames differ by
    # each encoding's losses, large at 32x32).
    assert float(np.abs(a[0].astype(np.int16) - b[0]).mean()) < 1.0
    first, ts = decode_span(short.video_file(0, CAM), 121 / short.fps, 123 / short.fps)
    assert ts[0] == pytest.approx(120 / short.fps)  # GOP 2: the seek lands one frame back, not on 100
    windows = [Window(0, 123, (121, 122, 123)), Window(0, 102, (100, 101, 102))]
    assert decoded_per_window(windows, 2) == 3.5 and decoded_per_window(windows, 100) == (24 + 3) / 2


@pytest.mark.parametrize("first, keyframe", [(80, 0), (100, 100), (120, 100), (146, 100)])
def test_seek_lands_on_the_keyframe_before_the_window(lerobot_root, first, keyframe):
    # GOP 100: keyframes at frames 0 and 100. Decoding starts there, as in
    # LeRobot's pyav path, and stops at the last requested frame.
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, 0, (0,))], action_horizon=4)
    frames, ts = decode_span(ds.video_file(0, CAM), first / ds.fps, (first + 3) / ds.fps)
    assert ts[0] == pytest.approx(keyframe / ds.fps)
    assert ts[-1] == pytest.approx((first + 3) / ds.fps)
    assert len(frames) == len(ts) == first + 3 - keyframe + 1


def test_timestamp_past_the_video_is_an_error(lerobot_root):
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, 0, (0,))], action_horizon=4)
    with pytest.raises(SourceDataError, match="tolerance"):
        decode_frames_pyav(ds.video_file(0, CAM), [1000.0], ds.tolerance_s)


def test_truncated_mp4_is_a_clear_error(lerobot_root, tmp_path):
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, 0, (0,))], action_horizon=4)
    data = open(ds.video_file(0, CAM), "rb").read()
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(SourceDataError):
        decode_frames_pyav(str(bad), [0.0], ds.tolerance_s)


def test_item_holds_the_window_rows_and_pads_the_action_at_the_episode_end(lerobot_root):
    import pyarrow.parquet as pq

    table = pq.read_table(lerobot_root / "data/chunk-000/episode_000001.parquet")
    n = table.num_rows
    state = np.stack(table.column("observation.state").to_numpy(zero_copy_only=False))
    action = np.stack(table.column("action").to_numpy(zero_copy_only=False))
    frames = (n - 3, n - 2, n - 1)
    ds = LeRobotVideoDataset(lerobot_root, [Window(1, n - 1, frames)], action_horizon=5)
    item = ds[0]
    assert item[CAM].shape == (3, 3, 32, 32) and item[CAM].dtype.is_floating_point
    assert 0.0 <= float(item[CAM].min()) and float(item[CAM].max()) <= 1.0
    np.testing.assert_array_equal(item["observation.state"].numpy(), state[list(frames)])
    np.testing.assert_array_equal(item["action"].numpy()[0], action[n - 1])
    np.testing.assert_array_equal(item["action"].numpy()[1:], np.repeat(action[n - 1 : n], 4, axis=0))
    assert item["action_is_pad"].tolist() == [False, True, True, True, True]
    assert isinstance(item["task"], str) and item["task"]


def test_dataloader_with_a_worker_batches_items(lerobot_root):
    windows = [Window(e, s + 1, (s, s + 1)) for e in (0, 1) for s in range(0, 140, 20)]
    ds = LeRobotVideoDataset(lerobot_root, windows, action_horizon=2)
    batches = list(make_baseline_loader(ds, batch_size=4, num_workers=1, seed=0))
    assert len(batches) == len(windows) // 4  # drop_last, as LeRobot trains
    assert batches[0][CAM].shape == (4, 2, 3, 32, 32)
    assert len(batches[0]["task"]) == 4


def test_unknown_backend_is_a_config_error(lerobot_root):
    with pytest.raises(ConfigError, match="backend"):
        LeRobotVideoDataset(lerobot_root, [], action_horizon=1, backend="decord")


def test_torchcodec_status_is_a_reason_or_none():
    status = torchcodec_status()
    if status is not None:
        assert "torchcodec" in status


def test_episode_start_sample_repeats_the_first_frame_and_reads_actions_from_t(lerobot_root, decode_all):
    """A sample at t=0 with K=4 frames at deltas -3..0 shows frame 0 four times (clamped, as the loader
    and LeRobot clamp); its state rows are row 0's and its action chunk starts at t."""
    import pyarrow.parquet as pq

    table = pq.read_table(lerobot_root / "data/chunk-000/episode_000000.parquet")
    state = np.stack(table.column("observation.state").to_numpy(zero_copy_only=False))
    action = np.stack(table.column("action").to_numpy(zero_copy_only=False))
    ds = LeRobotVideoDataset(lerobot_root, [Window(0, 0, (0, 0, 0, 0)), Window(0, 7, (5, 7))], action_horizon=3)
    first, later = ds[0], ds[1]
    truth = decode_all(ds.video_file(0, CAM))
    got = (first[CAM].permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    np.testing.assert_array_equal(got, np.stack([truth[0]] * 4))
    np.testing.assert_array_equal(first["observation.state"].numpy(), state[[0, 0, 0, 0]])
    np.testing.assert_array_equal(first["action"].numpy(), action[0:3])
    np.testing.assert_array_equal(later["action"].numpy(), action[7:10])  # from t, not from the first frame
