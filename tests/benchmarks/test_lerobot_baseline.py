"""The LeRobot baseline of benchmarks/loader/lerobot_baseline.py: its items are lerobot's own (bit for
bit, against what lerobot 0.6.1 returned for the v3.0 fixture), and the benchmark runs end to end
on a tiny input (figures are taken by the lead on a quiet machine, not here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loongforge.cli import main
from loongforge.benchmarks.loader.lerobot_style import LeRobotStyleDataset
from tests.outside import copy_fixture, fixture_dir


def test_baseline_items_are_lerobots(tmp_path):
    src = copy_fixture("lerobot_v3/video", tmp_path / "video")
    spec = json.loads((fixture_dir("lerobot_v3") / "video_items.json").read_text())
    z = np.load(fixture_dir("lerobot_v3") / "video_items.npz")
    ds = LeRobotStyleDataset(str(src), delta_timestamps=spec["delta_timestamps"])
    assert len(ds) == spec["len"]
    for i in z["indices"].tolist():
        item = ds[i]
        want = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}/")}
        assert set(item) == set(want)
        for key, ref in want.items():
            if key == "task":
                assert item[key] == str(ref)
            else:
                got = item[key].numpy()
                assert got.dtype == ref.dtype and got.shape == ref.shape
                np.testing.assert_array_equal(got, ref, err_msg=key)


def test_benchmark_runs_on_a_tiny_input(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "lerobot-baseline", "--episodes", "2", "--frames", "12", "16", "--size", "32", "--seconds",
               "0.2", "--workers", "0", "--batch-size", "4", "--settings", "gr00t", "--work", str(tmp_path),
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| av1 GOP 2 | gr00t | 0 |" in text and "| h264 GOP 250 | gr00t | 0 |" in text
    (result,) = out.glob("lerobot-baseline-*.json")
    doc = json.loads(result.read_text())
    assert len(doc["machine"]["load_average_start"]) == len(doc["machine"]["load_average_end"]) == 3
    rows = doc["rows"]
    assert [(r["encoding"], r["setting"]) for r in rows] == [("gop2", "gr00t"), ("gopL", "gr00t")]
    for r in rows:
        assert r["baseline"]["samples_per_s"] > 0 and r["loongforge"]["samples_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["loongforge"]["samples_per_s"] / r["baseline"]["samples_per_s"])
    assert list(tmp_path.glob("lf-lerobot-bench-*")) == []  # generated data removed


def test_benchmark_times_a_dataset_of_ones_own(tmp_path, capsys):
    """`--dataset ROOT` times the user's own data (its cameras, its fps) instead of the generated data: the
    benchmark took no dataset path, so nobody could check their own. A --work folder that does not exist
    yet is made."""
    src = copy_fixture("lerobot_v3/video", tmp_path / "mine")
    work = tmp_path / "not" / "yet"
    rc = main(["bench", "lerobot-baseline", "--dataset", str(src), "--seconds", "0.2", "--workers", "0",
               "--batch-size", "4", "--settings", "gr00t", "--work", str(work), "--out", str(tmp_path / "out")])
    assert rc == 0 and work.is_dir()
    assert f"| {src} | gr00t | 0 |" in capsys.readouterr().out
    (result,) = (tmp_path / "out").glob("lerobot-baseline-*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert row["encoding"] == str(src) and row["goal"] is None and row["loongforge"]["samples_per_s"] > 0


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "lerobot-baseline", "--help"])
    assert exit_info.value.code == 0
    assert "--episodes-per-file" in capsys.readouterr().out
