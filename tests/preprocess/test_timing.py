"""Each row's stored frame is the one its timestamp points at (preprocess/stages/timing.py), as
LeRobotDataset and GR00T's loader decode it, never a neighbour episode's; rows without a frame
are clamped, skipped or fail, and counted per camera in the summary, `inspect` and the index.

Real data: sample episodes re-encoded as LeRobot v3.0 (H.264, GOP 2, 3 episodes in one file),
then stamped from 1/fps (GR00T's demo data) or as a robot's wall clock (jitter, dropped frames:
a variable-frame-rate mp4). The expected frame of each row is computed here from the mp4's own
presentation times."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest

from loongforge.cli import main
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.stages.timing import FrameTiming, NearestFrames
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.preprocess.samples.layouts import shift_timestamps, wall_clock, write_v3
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import ConfigError, SourceDataError

FPS = 20
SMALL = {"episodes": 3, "frames": (14, 22), "height": 32, "width": 32, "gop": 6, "cameras": ("ego_view",)}


def _nearest(queries, times, tol=1e-4, mismatch="clamp"):
    m = NearestFrames(np.asarray(queries, float), FrameTiming(tol, mismatch))
    for t in times:
        m.push(t, None)
    m.finish()
    return m.result()


def test_rows_get_the_nearest_frame_and_are_counted():
    times = np.arange(5) / FPS
    same = _nearest(times, times)
    assert same.frame.tolist() == [0, 1, 2, 3, 4] and same.counts() == (0, 0, 0)
    later = _nearest(times + 1 / FPS, times)  # stamped from 1/fps: row r -> frame r + 1, the last row has none
    assert later.frame.tolist() == [1, 2, 3, 4, 4] and later.counts() == (4, 1, 0)
    tie = _nearest([0.025], [0.0, 0.05], tol=0.1)  # exactly between two frames: the earlier (LeRobot's argmin)
    assert tie.frame.tolist() == [0]
    skipped = _nearest(times + 1 / FPS, times, mismatch="skip")
    assert skipped.frame.tolist() == [1, 2, 3, 4, -1] and skipped.counts() == (4, 0, 1)
    unsorted = _nearest([0.1, 0.0, 0.05], times)  # rows need not be in time order
    assert unsorted.frame.tolist() == [2, 0, 1] and unsorted.counts() == (3, 0, 0)
    with pytest.raises(Exception, match="row 4 at 0.250000 s has no frame within 0.0001 s"):
        _nearest(times + 1 / FPS, times, mismatch="fail")


def test_bad_timing_options_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="choose one of"):
        PreprocessConfig(input="a", output="b", frame_mismatch="nearest")
    with pytest.raises(ConfigError, match="must be > 0"):
        PreprocessConfig(input="a", output="b", timestamp_tolerance_s=0)
    with pytest.raises(ConfigError, match="must be > 0"):
        FrameTiming(tolerance_s=-1)
    assert main(["preprocess", "--input", str(tmp_path), "--output", str(tmp_path / "o"),
                 "--timestamp-tolerance", "0"]) == 1
    assert "timestamp_tolerance_s=0.0: must be > 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def stamped(tmp_path_factory):
    """name -> v3.0 source: "gr00t" (rows stamped from 1/fps) and "robot" (wall clock: jitter and
    dropped frames, a variable-frame-rate mp4)."""
    tmp = tmp_path_factory.mktemp("stamped")
    v2 = generate_dataset(tmp / "v2", **SMALL)
    gr00t = shift_timestamps(write_v3(v2, tmp / "gr00t", codec="h264", gop=2))
    robot = write_v3(v2, tmp / "robot", codec="h264", gop=2, stamps=wall_clock(FPS, seed=3))
    return {"gr00t": gr00t, "robot": robot}


def _file_frames(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(presentation times, NV12 frames) of every frame of an mp4, by PyAV."""
    with av.open(path) as c:
        s = c.streams.video[0]
        times = np.array([float(f.pts * s.time_base) for f in c.decode(s)])
    return times, decode_nv12(path, len(times))[0]


def _expected(src) -> dict:
    """episode -> (per row the file frame LeRobot decodes for it, that frame's distance), the frame
    searched in the episode's span only."""
    meta, episodes = discover(str(src))
    (key, path), = episodes[0].videos
    times, frames = _file_frames(path)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    data = pq.read_table(episodes[0].parquet)
    out = {}
    for spec in episodes:
        start, end = spec.spans[0]
        inside = np.flatnonzero((times >= start - 0.5 / FPS) & (times < end - 0.5 / FPS))
        ts = data.filter(pc.equal(data.column("episode_index"), spec.index)).column("timestamp").to_numpy()
        q = start + ts.astype(np.float64)
        dist = np.abs(q[:, None] - times[inside][None, :])
        pick = inside[dist.argmin(1)]
        out[spec.index] = (frames[pick], dist.min(1))
    return out


def _frames_of(ds, e: int) -> np.ndarray:
    return np.concatenate([ds.read_block(e, "ego_view", b) for b in range(ds.num_blocks(e))])


def test_rows_stamped_from_one_frame_period_show_the_frame_lerobot_shows(stamped, tmp_path, run_in_memory, capsys):
    """GR00T's stamping: row t shows the file's frame t + 1 of its episode (what LeRobot and GR00T
    decode), the last row the episode's own last frame (LeRobot shows the next episode's first)."""
    src = stamped["gr00t"]
    out = str(tmp_path / "shards")
    summary = run_in_memory(str(src), out, block_frames=4)
    ds = open_root(out)
    want = _expected(src)
    lengths = []
    for e in range(ds.num_episodes):
        frames, dist = want[ds.episode_id(e)]
        got = _frames_of(ds, e)
        np.testing.assert_array_equal(got, frames)
        np.testing.assert_array_equal(got[-1], got[-2])  # the last row: clamped to the episode's last frame
        assert (dist[:-1] < 1e-4).all() and dist[-1] > 0.04
        lengths.append(len(got))
    cams = ds.info.source["frame_timing"]["cameras"]
    assert cams == {"observation.images.ego_view": {"shifted": sum(lengths) - 3, "clamped": 3, "skipped": 0}}
    assert summary["frame_timing"]["cameras"] == cams
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert f"observation.images.ego_view: {sum(lengths) - 3} rows shifted, 3 clamped, 0 skipped" in text
    assert "were clamped: observation.images.ego_view 3" in text


def test_wall_clock_stamps_with_dropped_frames(stamped, tmp_path, run_in_memory):
    """Jittered stamps find their own frame (after a dropped frame, a later one than the row's
    position); a row whose frame was dropped is clamped to the nearest (default), skipped (the row
    leaves the episode: arrays and frames), or fails the episode with a one-line reason."""
    src = stamped["robot"]
    want = _expected(src)
    dropped = {ep: int((dist >= 1e-4).sum()) for ep, (_, dist) in want.items()}
    assert all(n >= 1 for n in dropped.values())
    clamp, skip = str(tmp_path / "clamp"), str(tmp_path / "skip")
    run_in_memory(str(src), clamp, block_frames=4)
    run_in_memory(str(src), skip, block_frames=4, frame_mismatch="skip")
    ds, ds_skip = open_root(clamp), open_root(skip)
    for e in range(ds.num_episodes):
        frames, dist = want[ds.episode_id(e)]
        np.testing.assert_array_equal(_frames_of(ds, e), frames)
        keep = dist < 1e-4
        np.testing.assert_array_equal(_frames_of(ds_skip, e), frames[keep])
        arrays, full = ds_skip.read_arrays(e), ds.read_arrays(e)
        np.testing.assert_array_equal(arrays["timestamp"], full["timestamp"][keep])
        np.testing.assert_array_equal(arrays["state"], full["state"][keep])
    counts = ds.info.source["frame_timing"]["cameras"]["observation.images.ego_view"]
    assert counts["clamped"] == sum(dropped.values()) and counts["skipped"] == 0 and counts["shifted"] > 0
    skipped = ds_skip.info.source["frame_timing"]
    assert skipped["mismatch"] == "skip" and skipped["cameras"]["observation.images.ego_view"]["skipped"] == \
        sum(dropped.values())
    assert ds_skip.num_frames == ds.num_frames - sum(dropped.values())
    assert ds_skip.manifest["params"]["frame_mismatch"] == "skip" and "frame_mismatch" not in ds.manifest["params"]

    fail = str(tmp_path / "fail")
    summary = run_in_memory(str(src), fail, block_frames=4, frame_mismatch="fail")
    assert summary["failed"] == 3 and summary["episodes"] == 0
    reason = open_root(fail).manifest["failed"][0]["reason"]
    assert "has no frame within 0.0001 s" in reason and "--frame-mismatch clamp or skip" in reason
    assert "\n" not in reason


def test_a_wider_tolerance_takes_the_dropped_rows(stamped, tmp_path, run_in_memory):
    out = str(tmp_path / "wide")
    run_in_memory(str(stamped["robot"]), out, block_frames=4, timestamp_tolerance_s=2.0 / FPS)
    timing = open_root(out).info.source["frame_timing"]
    assert timing["tolerance_s"] == 0.1 and timing["cameras"]["observation.images.ego_view"]["clamped"] == 0
    assert open_root(out).manifest["params"]["timestamp_tolerance_s"] == 0.1


def test_v2_files_map_by_timestamp_too(tmp_path, run_in_memory):
    """v2.x: one mp4 per episode, the row's timestamp read against the file's own times."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = generate_dataset(tmp_path / "v2", **{**SMALL, "episodes": 1})
    meta, (spec,) = discover(str(src))
    table = pq.read_table(spec.parquet)
    col = table.schema.get_field_index("timestamp")
    ts = table.column(col).to_numpy()
    pq.write_table(table.set_column(col, "timestamp", pa.array((ts + 2 / FPS).astype(np.float32))), spec.parquet)
    out = str(tmp_path / "out")
    run_in_memory(str(src), out)
    ds = open_root(out)
    whole = decode_nv12(dict(spec.videos)["observation.images.ego_view"], len(ts))[0]
    got = _frames_of(ds, 0)
    np.testing.assert_array_equal(got[:-2], whole[2:])
    np.testing.assert_array_equal(got[-2:], whole[[-1, -1]])
    assert json.loads(json.dumps(ds.info.source["frame_timing"]["cameras"]))["observation.images.ego_view"] == \
        {"shifted": len(ts) - 2, "clamped": 2, "skipped": 0}


def test_decode_by_timestamp_without_a_frame_is_a_clear_error(tmp_path, stamped):
    meta, episodes = discover(str(stamped["gr00t"]))
    (_, path), = episodes[0].videos
    with pytest.raises(SourceDataError, match=r"no video frame in the episode's span"):
        decode_nv12(path, np.zeros(3), span=(1000.0, 1001.0))


def test_a_video_shorter_than_its_rows_is_clamped_by_default(quirky_dataset, tmp_path, run_in_memory, capsys):
    """The quirky dataset's last episode has 5 frames fewer than rows (per camera): by default its
    last 5 rows show its last frame, counted and warned about; the corrupt video still fails."""
    out = str(tmp_path / "shards")
    summary = run_in_memory(quirky_dataset, out, block_frames=4)
    assert summary["failed"] == 1 and summary["episodes"] == 3
    ds = open_root(out)
    cams = ds.info.source["frame_timing"]["cameras"]
    assert cams == {key: {"shifted": 0, "clamped": 5, "skipped": 0} for key in cams} and len(cams) == 2
    last = _frames_of(ds, ds.num_episodes - 1)
    assert all(np.array_equal(last[-1], f) for f in last[-6:])
