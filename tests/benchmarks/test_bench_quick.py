"""`loongforge bench --quick` end to end, as CI runs it: real generator, real
Beam preprocess, real cache daemon, real loaders. Checks that it runs and that
the JSON is well formed with every row present. No speed thresholds: figures
come only from the bench itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

QUICK_GOPS, WORKERS = (2, 20, 100), (0, 1, 2)  # the --quick preset's grid
# `make test` runs --quick on a 2 x 2 corner of that grid: the shortest and longest GOP, in-process and
# multi-worker loading; every kind of row and every check below still runs. The whole grid is `full`.
FAST_GOPS, FAST_WORKERS = (2, 100), (0, 2)
QUICK_BUDGET_S = 600  # ~3 min quiet (3 GOPs x 3 worker counts x 4 passes); the margin absorbs a loaded machine


def p1_cells(gops, workers) -> set[str]:
    return {f"P1/g{g}/w{w}{s}" for g in gops for w in workers
            for s in ("", "-nv12", "-threaded", "-v2", "-v2-threaded")}  # -v2*: the format-2 root, same cell


def expected_rows(gops, workers) -> set[str]:
    return p1_cells(gops, workers) | {"P1/rgb-conversion", "P1/worst", "P1/torchcodec", "P2/w1", "P2/w2", "P2/w1-v1",
                                      "P2/w2-v1", "P3/share", "P3/step", "P3/wait", "P4", "P5/transcode",
                                      "P5/transcode-v1", "P5/break-even"}  # P2-P5: format 2, -v1 beside it


def _run_quick(tmp, *extra):
    out, work = tmp / "results", tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "loongforge", "bench", "--quick", *extra, "--out", str(out),
                           "--workdir", str(work)], capture_output=True, text=True, timeout=QUICK_BUDGET_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out, work


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return _run_quick(tmp_path_factory.mktemp("bench"), "--gops", ",".join(map(str, FAST_GOPS)),
                      "--workers", ",".join(map(str, FAST_WORKERS)))


@pytest.mark.slow
def test_quick_bench_writes_a_complete_result(quick_run):
    check_complete_result(*quick_run[:2], FAST_GOPS, FAST_WORKERS)


@pytest.mark.slow
@pytest.mark.full
def test_quick_bench_full_grid_writes_a_complete_result(tmp_path):
    """`loongforge bench --quick` exactly as documented: the preset's 3 GOPs x 3 worker counts."""
    check_complete_result(*_run_quick(tmp_path)[:2], QUICK_GOPS, WORKERS)


def check_complete_result(proc, out, gops, workers):
    P1_CELLS, EXPECTED_ROWS = p1_cells(gops, workers), expected_rows(gops, workers)  # noqa: N806
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = list(out.glob("*.json"))
    assert len(results) == 1
    doc = json.loads(results[0].read_text())
    assert doc["result_version"] == 1 and doc["config"]["quick"] is True
    assert tuple(doc["config"]["gops"]) == gops and tuple(doc["config"]["workers"]) == workers
    m = doc["machine"]
    assert m["cpu_model"] and m["cores_usable"] >= 1 and m["libraries"]["torch"] and m["libraries"]["av"]
    rows = {r["id"]: r for r in doc["rows"]}
    assert set(rows) == EXPECTED_ROWS
    for row in rows.values():
        if row["id"] == "P1/torchcodec" and row["status"].startswith("not available: torchcodec"):
            continue  # every PyPI build for torch 2.13 is a CUDA build (see benchmarks/README.md)
        assert row["status"] == "ok", (row["id"], row["status"])
        assert row["ours"] and row["ours"]["min"] <= row["ours"]["median"] <= row["ours"]["max"]
        assert row["params"], row["id"]
    for rid in P1_CELLS:
        r = rows[rid]
        gop, w = int(rid.split("/")[1][1:]), int(rid.split("/")[2].split("-")[0][1:])
        assert r["params"]["gop"] == gop and r["params"]["workers"] == w, rid  # every row states its GOP
        assert r["params"]["cores"] == max(1, w) and r["params"]["pinned_cores"] is True
        assert r["params"]["baseline_backend"] == ("pyav-threaded" if rid.endswith("-threaded") else "pyav")
        assert r["params"]["format_version"] == (2 if "-v2" in rid else 1), rid
        assert "(cache daemon, hot)" in r["ours_label"]
        assert r["ratio"]["median"] == pytest.approx(r["ours"]["median"] / r["baseline"]["median"])
        # equal cores, counted: both sides' CPU seconds were read over the timed batches
        for side in ("baseline", "ours"):  # >= 0: a 10-batch quick pass can fall inside one 10 ms CPU tick
            assert r["extra"][f"{side}_samples_per_cpu_s"]["median"] >= 0 and f"{side}_busy_cores" in r["extra"]
        if r["params"]["output"].startswith("NV12"):
            assert r["goal"] == (">= 50x" if gop >= 100 else ">= 20x") and r["goal_met"] is not None
            assert r["goal_met"] or r["notes"], f"{rid} missed its goal without naming the bottleneck"
        else:
            assert r["goal_met"] is None  # float RGB: reported beside the goals
    # Same windows at every GOP: only what the baseline must decode per window changes, and it grows with the GOP.
    decoded = [rows[f"P1/g{g}/w0"]["params"]["baseline_decoded_frames_per_window"] for g in gops]
    assert decoded == sorted(decoded) and decoded[0] < decoded[-1]
    assert len({rows[f"P1/g{g}/w0"]["params"]["samples"] for g in gops}) == 1
    # The format-2 cells read as many samples of K frames as format 1's windows, from the same mp4.
    for g in gops:
        v1, v2 = rows[f"P1/g{g}/w0-nv12"], rows[f"P1/g{g}/w0-v2"]
        assert v2["params"]["frames_per_sample"] == v1["params"]["frames_per_sample"]
        assert abs(v2["params"]["samples"] - v1["params"]["samples"]) <= doc["config"]["episodes"]  # tail windows
        assert v2["baseline"] == v1["baseline"]  # the same baseline passes
    worst = rows["P1/worst"]
    nv12_w2 = ("w2-nv12", "w2-threaded", "w2-v2", "w2-v2-threaded")  # both formats: the headline hides neither
    assert worst["ratio"]["median"] == min(rows[r]["ratio"]["median"] for r in P1_CELLS if r.endswith(nv12_w2))
    assert worst["extra"]["format_2_worst_ratio"] is not None
    conv = rows["P1/rgb-conversion"]
    assert conv["baseline"]["median"] > 0 and conv["ours"]["median"] > 0 and conv["goal"] == ">= 3x"
    assert 0 <= rows["P3/share"]["ours"]["median"] <= 1 and 0 <= rows["P3/share"]["baseline"]["median"] <= 1
    assert {c["id"].split("/")[0] for c in doc["components"]} >= {"C-preprocess", "C-cache"}
    assert (out / results[0].with_suffix(".png").name).read_bytes()[:4] == b"\x89PNG"
    table = proc.stdout
    for rid in EXPECTED_ROWS:
        assert f"| {rid} |" in table
    assert doc["inputs"]["warm_cache"]["client"]["origin_reads"] == 0
    # P2-P5 read format 2 by default (what preprocess writes); P2 and P5 keep a format-1 cell beside it.
    for rid in ("P2/w1", "P2/w2", "P3/share", "P4", "P5/transcode", "P5/break-even"):
        assert rows[rid]["params"]["format_version"] == 2, rid
    for rid in ("P2/w1-v1", "P2/w2-v1", "P5/transcode-v1"):
        assert rows[rid]["params"]["format_version"] == 1, rid
    assert "BlockLoader" in rows["P3/share"]["ours_label"] and "BlockLoader" in rows["P2/w1"]["ours_label"]
    assert doc["inputs"]["warm_cache_v2"]["client"]["origin_reads"] == 0


@pytest.mark.slow
def test_baseline_and_shards_serve_the_same_windows(quick_run):
    """The baseline's frames of window i are the shard's sample i (same episode,
    frames, resolution), up to the NV12 round trip of the transcode."""
    from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset
    from loongforge.benchmarks.harness.data import windows_of
    from loongforge.shared.reader import ShardReader

    proc, _, work = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = ShardReader(str(work / "shards"))
    windows = windows_of(str(work / "shards"), reader.index)
    assert len(windows) == len(reader)
    ds = LeRobotVideoDataset(work / "lerobot", list(windows), action_horizon=reader.index.dataset.action_horizon)
    for i in (0, len(windows) // 2, len(windows) - 1):
        sample = reader[i]
        assert (sample.episode, tuple(sample.frame_indices)) == (windows[i].episode, windows[i].frames)
        item = ds[i]
        for cam in reader.index.dataset.cameras:
            ours = reader.rgb(sample, cam.slot).astype(np.float32) / 255.0
            base = item[cam.key].permute(0, 2, 3, 1).numpy()
            assert ours.shape == base.shape
            # Same pixels up to chroma subsampling and rounding of the transcode.
            assert float(np.abs(ours - base).mean()) < 0.03
        np.testing.assert_allclose(item["observation.state"].numpy(), sample.state, atol=1e-6)


@pytest.mark.slow
def test_p1_formats_compares_both_roots_and_counts_block_decodes(quick_run, tmp_path):
    """benchmarks/loader/p1_formats.py on the quick run's two roots: both formats timed per worker count,
    format 2's decodes counted (not timed), and a pass that would run past the epoch refused."""
    import json

    from loongforge.benchmarks.loader import p1_formats
    from loongforge.shared.errors import ConfigError

    proc, _, work = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = ["--workdir", str(work), "--reuse", "--rounds", "1", "--out", str(tmp_path)]
    assert p1_formats.main([*base, "--batches", "3", "--workers", "0,1"]) == 0
    doc = json.loads(next(tmp_path.glob("p1-formats-*.json")).read_text())
    assert [r["workers"] for r in doc["rows"]] == [0, 1]
    for r in doc["rows"]:
        assert r["v1_samples_per_s"]["median"] > 0 and r["v2_samples_per_s"]["median"] > 0
    from loongforge.shared.dataset_v2 import open_v2

    d, ds = doc["decodes"], open_v2(str(work / "shards_v2"))
    blocks = sum(ds.num_blocks(e) for e in range(ds.num_episodes)) * len(ds.cameras)
    # K=4 at stride 4 over blocks of B=16, 2 cameras: a block serves at most B/stride samples, so >= 2*4/16
    # decodes a sample; the quick root fits a worker's block cache, so no block is decoded twice.
    assert 2 * 4 / d["block_size"] <= d["block_decodes_per_sample"]
    assert round(d["block_decodes_per_sample"] * d["samples"]) <= blocks
    assert d["frames_decompressed_per_sample_v1"] == 8
    with pytest.raises(ConfigError, match="pass the epoch"):
        p1_formats.main([*base, "--batches", "40", "--workers", "0"])
