"""`loongforge bench data --quick` end to end, as CI runs it: real generator, real
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
    return {f"P1/g{g}/w{w}{s}" for g in gops for w in workers for s in ("", "-nv12", "-threaded")}


def expected_rows(gops, workers) -> set[str]:
    return p1_cells(gops, workers) | {"P1/rgb-conversion", "P1/worst", "P1/torchcodec", "P2/w1", "P2/w2",
                                      "P3/share", "P3/step", "P3/wait", "P4", "P5/transcode", "P5/break-even"}


def _run_quick(tmp, *extra):
    out, work = tmp / "results", tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "loongforge", "bench", "data", "--quick", *extra, "--out", str(out),
                           "--workdir", str(work)], capture_output=True, text=True, timeout=QUICK_BUDGET_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out, work


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return _run_quick(tmp_path_factory.mktemp("bench"), "--gops", ",".join(map(str, FAST_GOPS)),
                      "--workers", ",".join(map(str, FAST_WORKERS)))


@pytest.mark.slow
@pytest.mark.full  # the bench harness end to end (80 s of set-up); `make bench-quick` runs it
def test_quick_bench_writes_a_complete_result(quick_run):
    check_complete_result(*quick_run[:2], FAST_GOPS, FAST_WORKERS)


@pytest.mark.slow
@pytest.mark.full
def test_quick_bench_full_grid_writes_a_complete_result(tmp_path):
    """`loongforge bench data --quick` exactly as documented: the preset's 3 GOPs x 3 worker counts."""
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
        assert r["ours_label"].startswith("BlockLoader (cache daemon, hot)"), rid
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
    worst = rows["P1/worst"]
    nv12_w2 = ("w2-nv12", "w2-threaded")  # both baselines: the headline hides neither
    assert worst["ratio"]["median"] == min(rows[r]["ratio"]["median"] for r in P1_CELLS if r.endswith(nv12_w2))
    conv = rows["P1/rgb-conversion"]
    assert conv["baseline"]["median"] > 0 and conv["ours"]["median"] > 0 and conv["goal"] == ">= 3x"
    assert 0 <= rows["P3/share"]["ours"]["median"] <= 1 and 0 <= rows["P3/share"]["baseline"]["median"] <= 1
    assert {c["id"].split("/")[0] for c in doc["components"]} >= {"C-preprocess", "C-cache"}
    assert (out / results[0].with_suffix(".png").name).read_bytes()[:4] == b"\x89PNG"
    table = proc.stdout
    for rid in EXPECTED_ROWS:
        assert f"| {rid} |" in table
    assert doc["inputs"]["warm_cache"]["client"]["origin_reads"] == 0
    assert "BlockLoader" in rows["P3/share"]["ours_label"] and "BlockLoader" in rows["P2/w1"]["ours_label"]
    samples = rows["P1/g2/w0"]["params"]["samples"]
    assert rows["P5/break-even"]["params"]["samples_per_epoch"] == samples == doc["inputs"]["samples"]


@pytest.mark.slow
@pytest.mark.full  # shares the quick bench run above
def test_baseline_and_shards_serve_the_same_samples(quick_run):
    """The baseline's window i is the shard root's sample i (same episode, t, frames shown, state and
    action rows), up to the NV12 round trip of the transcode."""
    from loongforge.benchmarks.harness.config import BenchConfig
    from loongforge.benchmarks.harness.data import deltas_of, windows_of
    from loongforge.benchmarks.harness.dataset import SampleTable, open_root
    from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset
    from loongforge.shared.color import nv12_to_rgb

    proc, _, work = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg, root = BenchConfig.quick_preset(), str(work / "shards")
    ds, deltas = open_root(root), deltas_of(cfg)
    table = SampleTable(ds.episode_lengths, stride=cfg.stride)
    windows = windows_of(root, deltas, cfg.stride)
    assert len(windows) == table.num_samples
    base = LeRobotVideoDataset(work / "lerobot", list(windows), action_horizon=deltas.action_horizon)
    info = ds.info
    for i in (0, 1, len(windows) // 2, len(windows) - 1):
        (e,), (t,) = table.locate([i])
        w, length = windows[i], int(table.lengths[e])
        assert (w.episode, w.t, w.frames[-1]) == (ds.episode_id(int(e)), t, t) and len(w.frames) == cfg.frames_per_sample
        assert w.frames == tuple(max(0, t + d) for d in deltas.video)  # clamped at the episode start
        item, arrays = base[i], ds.read_arrays(int(e))
        for cam in info.cameras:
            nv12 = np.stack([ds.read_block(int(e), cam.slot, f // ds.block_size)[f % ds.block_size] for f in w.frames])
            ours = nv12_to_rgb(nv12, info.color_matrix, info.color_range).astype(np.float32) / 255.0
            theirs = item[cam.key].permute(0, 2, 3, 1).numpy()
            assert ours.shape == theirs.shape
            assert float(np.abs(ours - theirs).mean()) < 0.03  # chroma subsampling and rounding of the transcode
        np.testing.assert_allclose(item["observation.state"].numpy(), arrays["state"][list(w.frames)], atol=1e-6)
        rows = np.minimum(t + np.arange(deltas.action_horizon), length - 1)
        np.testing.assert_allclose(item["action"].numpy(), arrays["action"][rows], atol=1e-6)
