"""Job options from the outside review: one frame per sample, an input
fingerprint that sees the videos, progress on the local runner, Beam counters."""

import logging
import os
import shutil
from pathlib import Path

from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.runner.progress import ProgressMonitor
from loongforge.shared.dataset import open_root


def test_one_frame_per_sample_every_timestep(sample_dataset, tmp_path, run_in_memory):
    """The GR00T N1.x setting: every timestep is a sample, by construction of the format (frames
    stored once; the loader shapes samples), with no window flag to pass."""
    out = str(tmp_path / "k1")
    summary = run_in_memory(sample_dataset, out)
    _, episodes = discover(sample_dataset)
    assert summary["failed"] == 0 and summary["samples"] == sum(e.length for e in episodes)
    ds = open_root(out)
    assert ds.info.frames_per_sample == 1 and ds.num_frames == summary["samples"]
    assert [int(n) for n in ds.episode_lengths] == [e.length for e in sorted(episodes, key=lambda e: e.index)]


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)  # copy2: sizes and mtimes preserved
    return dst


def test_fingerprint_sees_changed_and_truncated_videos(sample_dataset, tmp_path):
    root = _copy(sample_dataset, tmp_path / "ds")
    base = discover(str(root))[0].fingerprint
    assert discover(str(root))[0].fingerprint == base  # stable
    video = sorted(root.rglob("*.mp4"))[1]
    st = video.stat()
    # Same size, same mtime, one byte changed: only the content mode sees it.
    data = bytearray(video.read_bytes())
    data[len(data) // 2] ^= 0xFF
    video.write_bytes(bytes(data))
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert discover(str(root))[0].fingerprint == base
    content = discover(str(root), "content")[0].fingerprint
    assert content != discover(str(_copy(sample_dataset, tmp_path / "pristine")), "content")[0].fingerprint
    # Truncated (new size) or touched (new mtime): the default mode sees both.
    video.write_bytes(bytes(data[:-100]))
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns))
    truncated = discover(str(root))[0].fingerprint
    assert truncated != base
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert discover(str(root))[0].fingerprint not in (base, truncated)


def test_progress_line_counts_staging_files(tmp_path):
    staging = tmp_path / "_staging"
    staging.mkdir()
    now = [100.0]
    lines: list[str] = []
    mon = ProgressMonitor(str(tmp_path), {0: 50, 1: 70, 2: 30, 3: -1}, cameras=2, interval_s=60,
                          emit=lines.append, clock=lambda: now[0])
    assert mon.snapshot().line() == "progress: 0/4 episodes (0 failed)"
    (staging / "episode_000000.bin").write_bytes(b"x")
    (staging / "episode_000002.failed").write_bytes(b"{}")
    (staging / ".tmp-abc-episode_000001.bin").write_bytes(b"")  # an atomic write in flight: not done
    now[0] = 110.0
    assert mon.snapshot().line() == "progress: 2/4 episodes (1 failed), 10 frames/s, ETA 00:00:10"
    shutil.rmtree(staging)  # finalize removed it: the last line comes from the job's totals
    mon.finish(converted=3, failed=1, frames=300)
    assert lines[-1] == "progress: 4/4 episodes (1 failed), 30 frames/s, done in 10.0 s"


def test_local_run_logs_progress_and_returns_counters(sample_dataset, tmp_path, caplog, run_in_memory):
    with caplog.at_level(logging.INFO, logger="loongforge.preprocess.runner.progress"):
        summary = run_in_memory(sample_dataset, str(tmp_path / "out"), progress_s=0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "loongforge.preprocess.runner.progress"]
    assert len(lines) >= 2 and all("/3 episodes" in line for line in lines)
    assert lines[-1].startswith("progress: 3/3 episodes (0 failed)") and "done in" in lines[-1]
    counters = summary["counters"]
    assert counters["episodes_converted"] == 3 and counters.get("episodes_failed", 0) == 0
    assert counters["samples"] == summary["samples"] and counters["shards_written"] == summary["shards"]
    assert counters["frames_decoded"] == summary["source_frames"] * 2
    assert open_root(str(tmp_path / "out")).num_frames == summary["samples"]


def test_episode_events_count_each_attempt_once_and_drive_the_progress_line():
    """The Dask runner's progress channel: each conversion attempt's event, counted once however
    often it arrives (live, then again from the scheduler's log); a failed attempt retried into a
    conversion is converted; the progress line reads the same as the local runner's."""
    from loongforge.preprocess.runner.progress import EpisodeEvents, report_episode

    events = EpisodeEvents()
    sent = [{"episode": 0, "ok": True, "worker": "tcp://a:1", "attempt": "x0"},
            {"episode": 1, "ok": False, "worker": "tcp://b:1", "attempt": "x1"},
            {"episode": 2, "ok": False, "worker": "tcp://a:1", "attempt": "x2"},
            {"episode": 2, "ok": True, "worker": "tcp://b:1", "attempt": "x3"}]
    for msg in sent + sent[:2]:
        events.handle((123.0, msg))
    assert events.finished() == ({0, 2}, {1})
    assert events.conversions() == {"attempts": 4, "by_worker": {"tcp://a:1": 2, "tcp://b:1": 2}, "repeated": [2]}
    now = iter([0.0, 6.0])
    mon = ProgressMonitor("unused", {0: 10, 1: 10, 2: 10, 3: 10}, cameras=1, interval_s=60, emit=lambda _: None,
                          clock=lambda: next(now), finished=events.finished)
    assert mon.snapshot().line() == "progress: 3/4 episodes (1 failed), 3 frames/s, ETA 00:00:02"
    report_episode("a-topic", 0, ok=True)  # outside a dask worker: nowhere to report, and no error
