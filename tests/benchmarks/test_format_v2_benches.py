"""The format-2 benchmark commands run end to end at tiny sizes and write their
JSON (figures themselves are not asserted: they come from the full runs)."""

from __future__ import annotations

import json

from loongforge.benchmarks.micro import index_scale, storage as storage_v2


def test_index_scale_runs_and_builds_a_valid_v2_index(tmp_path, capsys):
    assert index_scale.main(["--v2-samples", "20000", "--v1-samples", "5000", "--lookups", "500",
                             "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| v2 mmap tables | 20,000 |" in out and "(extrapolated)" in out
    doc = json.loads(next(tmp_path.glob("index-scale-*.json")).read_text())
    assert [r["samples"] for r in doc["rows"]] == [5000, 20000, 20000]
    assert doc["built"]["v2"]["episodes"] > 10 and doc["raw"]["v2"]["locate_us"] > 0


def test_index_scale_synthetic_tables_locate_like_brute_force(tmp_path):
    from loongforge.shared.dataset_v2 import open_v2

    index_scale.build_v2_index(str(tmp_path), 5000, 16)
    ds = open_v2(str(tmp_path))
    starts = [int(x) for x in ds.episode_starts]
    for n in (0, 1, 299, 300, 4999, 2500):
        e, t = ds.locate(n)
        assert starts[e] <= n < starts[e + 1] and t == n - starts[e]


def test_storage_v2_runs(tmp_path, capsys):
    assert storage_v2.main(["--footage", "grain,camera", "--episodes", "1", "--frames", "20", "24", "--blocks", "4,8",
                            "--levels", "3,5", "--level-block", "4", "--loader-batches", "1", "--repeats", "1",
                            "--decode-rounds", "2",
                            "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("storage-v2-*.json")).read_text())
    assert sorted(doc["footage"]) == ["camera", "grain"]
    for part in doc["footage"].values():
        rows = part["rows"]
        assert [(r["format"], r["codec"], r["zstd_level"]) for r in rows] == [
            ("v1 K=1 stride 1", "zstd", 3), ("v2 B=4", "zstd", 3), ("v2 B=4", "delta-zstd", 3), ("v2 B=8", "zstd", 3),
            ("v2 B=8", "delta-zstd", 3), ("v2 B=4", "zstd", 5), ("v2 B=4", "delta-zstd", 5)]
        assert all(r["over_mp4"] > 0 and r["frames"] > 0 and r["block_ratio"] > 1 for r in rows)
        assert all(r["loader_samples_per_s"] > 0 for r in rows[1:5])
        d = part["decode_interleaved"]
        assert d["block"] == 4 and sorted(d["us_per_frame"]) == ["delta-zstd", "zstd"]
        assert all(len(v) == 2 for v in d["all_us_per_frame"].values())
    # the camera model is what lossless block coding can exploit; the grain is not
    assert doc["footage"]["camera"]["rows"][3]["block_ratio"] > 2 * doc["footage"]["grain"]["rows"][3]["block_ratio"]
    assert "| source mp4" in capsys.readouterr().out


def test_storage_v2_measures_an_existing_lerobot_root(tmp_path, capsys):
    """--lerobot: a user's own (real) footage, its mp4s the reference, its codec and GOP reported."""
    import os

    from loongforge.preprocess.sample_data import generate_dataset

    root = generate_dataset(tmp_path / "lerobot", episodes=2, frames=(12, 16), height=32, width=32,
                            cameras=("image",), state_dim=8, action_dim=7, gop=5)
    mp4 = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs if f.endswith(".mp4"))
    assert storage_v2.main(["--footage", "", "--lerobot", str(root), "--blocks", "4", "--codecs", "zstd",
                            "--repeats", "1", "--decode-rounds", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("storage-v2-*.json")).read_text())
    (key, part), = doc["footage"].items()
    assert key == f"lerobot:{root}" and part["mp4_bytes"] == mp4 and part["episodes"] == 2
    import re

    keys, frames = map(int, re.fullmatch(r"h264, (\d+) keyframes in (\d+) frames", part["gop"]).groups())
    assert 12 <= frames <= 16 and keys == -(-frames // 5)  # the first episode's mp4, GOP 5
    assert [r["format"] for r in part["rows"]] == ["v1 K=1 stride 1", "v2 B=4"]
    assert "| source mp4 (h264, " in capsys.readouterr().out


def test_storage_v2_refuses_nothing_to_measure(tmp_path):
    import pytest

    with pytest.raises(SystemExit):
        storage_v2.main(["--footage", "", "--out", str(tmp_path)])
