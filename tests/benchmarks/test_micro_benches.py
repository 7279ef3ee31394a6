"""The storage and index benchmark commands run end to end at tiny sizes and write their
JSON (figures themselves are not asserted: they come from the full runs)."""

from __future__ import annotations

import json

import pytest

from loongforge.benchmarks.cli import main as bench
from loongforge.benchmarks.micro import index_scale, startup


def test_index_scale_runs_both_indexes_and_extrapolates_the_json_one(tmp_path, capsys):
    assert bench(["index-scale", "--samples", "20000", "--json-samples", "5000", "--lookups", "500",
                  "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| mmap tables (shard root) | 20,000 |" in out and "| JSON tables (json.load) (extrapolated) | 20,000 |" in out
    doc = json.loads(next(tmp_path.glob("index-scale-*.json")).read_text())
    assert [r["samples"] for r in doc["rows"]] == [5000, 20000, 20000]
    assert doc["built"]["tables"]["episodes"] > 10 and doc["built"]["json"]["blocks"] > 5000 // 700
    for kind in ("tables", "json"):
        assert doc["raw"][kind]["locate_us"] > 0 and doc["raw"][kind]["block_entry_us"] > 0


def test_index_scale_tables_and_json_index_agree_and_locate_like_brute_force(tmp_path):
    from loongforge.benchmarks.harness.dataset import open_root

    index_scale.build_root_index(str(tmp_path / "root"), 5000, 16)
    index_scale.build_json_index(str(tmp_path), 5000, 16)
    ds = open_root(str(tmp_path / "root"))
    doc = json.loads((tmp_path / index_scale.JSON_INDEX).read_text())
    starts = [int(x) for x in ds.episode_starts]
    assert doc["episode_start"] == starts  # the baseline holds the very same tables
    for n in (0, 1, 299, 300, 4999, 2500):
        e, t = ds.locate(n)
        assert starts[e] <= n < starts[e + 1] and t == n - starts[e]
        b = t // 16
        name, off, length, frames, digest = ds.block_entry(e, 0, b)
        assert doc["blocks"][doc["first_block"][e][0] + b] == [off, length, frames, digest]


def test_storage_runs(tmp_path, capsys):
    assert bench(["storage", "--footage", "grain,camera", "--episodes", "1", "--frames", "20", "24", "--blocks", "4,8",
                  "--levels", "3,5", "--level-block", "4", "--loader-batches", "1", "--repeats", "1",
                  "--decode-rounds", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("storage-*.json")).read_text())
    assert sorted(doc["footage"]) == ["camera", "grain"]
    for part in doc["footage"].values():
        rows = part["rows"]
        assert [(r["format"], r["codec"], r["zstd_level"]) for r in rows] == [
            ("blocks B=4", "zstd", 3), ("blocks B=4", "delta-zstd", 3), ("blocks B=8", "zstd", 3),
            ("blocks B=8", "delta-zstd", 3), ("blocks B=4", "zstd", 5), ("blocks B=4", "delta-zstd", 5)]
        assert all(r["over_mp4"] > 0 and r["frames"] > 0 and r["block_ratio"] > 1 for r in rows)
        assert all(r["loader_samples_per_s"] > 0 for r in rows[:4])
        assert part["mp4_decode_cpu_us_per_frame"] > 0  # the baseline: decoding the source mp4
        d = part["decode_interleaved"]
        assert d["block"] == 4 and sorted(d["us_per_frame"]) == ["delta-zstd", "zstd"]
        assert all(len(v) == 2 for v in d["all_us_per_frame"].values())
    # the camera model is what lossless block coding can exploit; the grain is not
    assert doc["footage"]["camera"]["rows"][2]["block_ratio"] > 2 * doc["footage"]["grain"]["rows"][2]["block_ratio"]
    assert "| source mp4" in capsys.readouterr().out


def test_storage_measures_an_existing_lerobot_root(tmp_path, capsys):
    """--lerobot: a user's own (real) footage, its mp4s the reference, its codec and GOP reported."""
    import os
    import re

    from loongforge.preprocess.samples.dataset import generate_dataset

    root = generate_dataset(tmp_path / "lerobot", episodes=2, frames=(12, 16), height=32, width=32,
                            cameras=("image",), state_dim=8, action_dim=7, gop=5)
    mp4 = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs if f.endswith(".mp4"))
    assert bench(["storage", "--footage", "", "--lerobot", str(root), "--blocks", "4", "--codecs", "zstd",
                  "--repeats", "1", "--decode-rounds", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("storage-*.json")).read_text())
    (key, part), = doc["footage"].items()
    assert key == f"lerobot:{root}" and part["mp4_bytes"] == mp4 and part["episodes"] == 2
    keys, frames = map(int, re.fullmatch(r"h264, (\d+) keyframes in (\d+) frames", part["gop"]).groups())
    assert 12 <= frames <= 16 and keys == -(-frames // 5)  # the first episode's mp4, GOP 5
    assert [r["format"] for r in part["rows"]] == ["blocks B=4"]
    assert "| source mp4 (h264, " in capsys.readouterr().out


def test_storage_refuses_nothing_to_measure(tmp_path, capsys):
    assert bench(["storage", "--footage", "", "--out", str(tmp_path)]) == 2
    assert "nothing to measure" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.full
def test_preprocess_dask_runs_its_three_rows_on_one_dataset(tmp_path, capsys):
    """`loongforge bench preprocess-dask --quick`: local-2, dask-1, dask-2 on the same data, every
    index identical, each dask episode converted once, the efficiency and the load recorded."""
    assert bench(["preprocess-dask", "--quick", "--out", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "scaling efficiency dask-2 over dask-1" in out
    doc = json.loads(next(tmp_path.glob("preprocess-dask-*.json")).read_text())
    assert [r["id"] for r in doc["rows"]] == ["local-2", "dask-1", "dask-2"]
    assert all(r["index_identical"] and r["frames"] == 4 * 30 * 2 for r in doc["rows"])
    assert [len(r["conversions"]["by_worker"]) for r in doc["rows"][1:]] == [1, 2]
    assert all(r["conversions"]["repeated"] == [] for r in doc["rows"][1:])
    assert doc["scaling_efficiency"] > 0 and len(doc["load_average_end"]) == 3


def test_image_transform_runs_every_path(capsys):
    assert bench(["image-transform", "--batch", "2", "--cameras", "12x16,14x10", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for path in ("interpolate eval", "interpolate crop", "matrix eval", "matrix crop", "matrix crop + jitter"):
        assert f"| {path} |" in out


def test_startup_table_shows_the_split_the_ratio_and_each_goal():
    run = {"wall_s": 3.0, "x_import_torch": 2.5, "split_s": {**{c: 0.1 for c in startup.COLUMNS}, "after": 0.2}}
    doc = {"import_torch_s": {"median": 1.2}, "floor_s": {"median": 2.4, "x_import_torch": 2.0}, "one_rank": run, "two_ranks": {**run, "x_import_torch": 4.0},
           "restart": {"restart_s": 6.0, "killed_after_step": 3,
                       "split_s": {"detect": 1.0, "plan": 0.5, "launch": 0.5, **{c: 0.5 for c in startup.COLUMNS}}},
           "goals": {"one_rank_x_import_torch": {"goal": 2.5, "measured": 2.5, "met": True},
                     "restart_s": {"goal": 5.0, "measured": 6.0, "met": False}}}
    out = startup.table(doc)
    assert "| tiny, 1 step, 1 rank | 3.00 | 2.50x | 0.10 | 0.10 | 0.10 | 0.10 | 0.10 | 0.10 | 0.20 |" in out
    assert "| rank 1 of 2 SIGKILLed after step 3, relaunched on 1 | 6.00 | 1.00 | 0.50 | 0.50 |" in out
    assert "| floor: import torch, deepspeed, transformers' blocks | 2.40 | 2.00x |" in out
    assert ("goal one_rank_x_import_torch: <= 2.5 x import torch: measured 2.5 x import torch: met (the floor "
            "alone: 2.0 x import torch)") in out
    assert "goal restart_s: <= 5.0 s: measured 6.0 s: MISSED" in out


@pytest.mark.slow
@pytest.mark.full  # ~1-2 min of launches (1 and 2 ranks, an elastic run with a rank killed); its table: the test above
def test_startup_bench_runs_end_to_end(tmp_path, capsys):
    assert bench(["startup", "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny, 1 step, 1 rank |" in out and "| rank 1 of 2 SIGKILLed after step 3, relaunched on 1 |" in out
    doc = json.loads(next(tmp_path.glob("startup-*.json")).read_text())
    one, restart = doc["one_rank"], doc["restart"]
    assert 0 < doc["import_torch_s"]["median"] < doc["floor_s"]["median"] < one["wall_s"] * 1.5
    assert sum(one["split_s"].values()) == pytest.approx(one["wall_s"], rel=0.2)  # the split accounts for the run
    assert restart["split_s"]["imports"] < one["split_s"]["imports"]  # the relaunched rank was forked, warm
    assert 0 < restart["restart_s"] and set(doc["goals"]) == {"one_rank_x_import_torch", "restart_s"}
