"""`loongforge sample-data | preprocess | inspect` through the real console entry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loongforge.cli import main


@pytest.fixture(scope="module")
def cli_job(tmp_path_factory):
    """`loongforge sample-data` then `loongforge preprocess --workers 2` (multi-process Beam workers, the
    default local runner) as a user runs it; two tests read its output, so the job runs once."""
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("cli")
    data, out = str(tmp / "ds"), str(tmp / "shards")
    assert main(["sample-data", data, "--episodes", "3", "--frames", "12", "16", "--gop", "4"]) == 0
    run = subprocess.run([sys.executable, "-m", "loongforge", "preprocess", "--input", data, "--output", out,
                          "--workers", "2", "--shard-size", "256KB"], capture_output=True, text=True, timeout=300)
    return run, out


@pytest.mark.slow
def test_sample_data_preprocess_inspect(cli_job, capsys):
    run, out = cli_job
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "episodes   3 converted, 0 failed" in text and "frames/s" in text and "ratio" in text
    # The console: the progress line and the summary; per-episode and per-shard INFO lines, and Beam's notice
    # that BigQuery's client is missing (a connector preprocess never uses), stay off it.
    for noise in (r"episode \d+: \d+ frames x", r"wrote shards/shard-", r"No module named google\.cloud\.bigquery",
                  r" WARNING root: apitools not found"):
        assert not re.search(noise, run.stderr), (noise, run.stderr[-3000:])

    assert main(["inspect", out, "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("format_version", "episodes", "samples", "frames", "shards", "bytes", "cameras", "failed"):
        assert key in report
    assert report["episodes"] == 3 and report["failed"] == 0 and report["verified"] is True
    assert report["shards"] >= 2 and report["cameras"] == ["observation.images.ego_view",
                                                           "observation.images.wrist_view"]

    shard = Path(out) / "shards" / "shard-000001.tar"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[700] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))
    assert main(["inspect", out, "--verify"]) == 1
    assert "FAILED: shards/shard-000001.tar" in capsys.readouterr().out


def test_in_memory_runner_options_pass_through(tmp_path, capsys):
    data, out = str(tmp_path / "ds"), str(tmp_path / "shards")
    assert main(["sample-data", data, "--episodes", "1", "--frames", "8", "8", "--cameras", "front",
                 "--quirks", "corrupt_video"]) == 0
    rc = main(["preprocess", "--input", data, "--output", out, "--json", "--",
               "--direct_running_mode=in_memory", "--direct_num_workers=1"])
    assert rc == 3  # a record failed and --allow-failed is 0; the summary still prints
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] == 1 and summary["samples"] == 0 and summary["episodes"] == 0
    assert "unreadable" in summary["failed_records"][0]["reason"]


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    assert main(["preprocess", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--height", "63",
                 "--width", "64"]) == 1
    assert "height=63" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no index.json" in capsys.readouterr().err


@pytest.mark.slow
def test_local_workers_log_progress_not_harness_chatter(cli_job):
    """The job prints its progress line (per-episode lines are DEBUG), not the Beam harness's per-worker
    gRPC set-up at INFO."""
    run, _ = cli_job
    assert run.returncode == 0, run.stderr[-3000:]
    assert "progress: 3/3 episodes (0 failed)" in run.stderr, run.stderr[-3000:]
    assert "sdk_worker" not in run.stderr and "Pipeline_options" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow  # multi-process Beam workers: the error crosses a process boundary
def test_disk_full_output_is_one_clear_error_and_publishes_nothing(tmp_path, tiny_disk, capsys):
    data, out = str(tmp_path / "ds"), str(tiny_disk / "shards")
    assert main(["sample-data", data, "--episodes", "3"]) == 0
    capsys.readouterr()
    assert main(["preprocess", "--input", data, "--output", out, "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert "loongforge preprocess: error: disk full writing under " + out in err
    assert "No space left on device" in err and "Nothing was published" in err
    assert "Traceback" not in err
    assert not (tiny_disk / "shards" / "index.json").exists()


@pytest.mark.parametrize("allow, rc", [("0", 3), ("2", 0), ("25%", 3), ("50%", 0)])
def test_failed_records_set_the_exit_code(quirky_dataset, tmp_path, capsys, allow, rc):
    """The quirky dataset: 4 episodes, 2 fail (corrupt video; a short video, its last rows without a frame
    under --frame-mismatch fail)."""
    out = str(tmp_path / "shards")
    got = main(["preprocess", "--input", quirky_dataset, "--output", out, "--allow-failed", allow,
                "--frame-mismatch", "fail", "--",
                "--direct_running_mode=in_memory", "--direct_num_workers=1"])
    captured = capsys.readouterr()
    assert got == rc
    assert "episodes   2 converted, 2 failed" in captured.out  # the summary prints either way
    assert (Path(out) / "index.json").exists()
    assert ("exit 3" in captured.err) == (rc == 3)


def test_allow_failed_is_validated(tmp_path, capsys):
    assert main(["preprocess", "--input", str(tmp_path), "--output", str(tmp_path / "o"),
                 "--allow-failed", "lots"]) == 1
    assert "allow_failed='lots'" in capsys.readouterr().err


def test_sample_data_footage_flag(tmp_path):
    """--footage camera reaches the generator: the same mp4 bytes as generate_dataset(footage="camera")."""
    from loongforge.preprocess.samples.dataset import generate_dataset

    args = ["--episodes", "1", "--frames", "6", "6", "--cameras", "front"]
    assert main(["sample-data", str(tmp_path / "cam"), *args, "--footage", "camera"]) == 0
    assert main(["sample-data", str(tmp_path / "grain"), *args]) == 0
    want = generate_dataset(tmp_path / "ref", episodes=1, frames=(6, 6), cameras=("front",), footage="camera")
    mp4 = sorted(Path(want).rglob("*.mp4"))[0].relative_to(want)
    assert (tmp_path / "cam" / mp4).read_bytes() == (want / mp4).read_bytes() != (tmp_path / "grain" / mp4).read_bytes()
