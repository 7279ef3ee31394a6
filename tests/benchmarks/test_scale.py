"""`loongforge bench scale`: the alpha-beta fits recover known parameters, the projection picks
NVLink / InfiniBand by a group's span and flags comm share > 30%, the report labels measured and
projected figures; one real 1- and 2-rank run end to end (`-m full`)."""

from __future__ import annotations

import json

import pytest

from loongforge.benchmarks.scale import alpha_beta as ab
from loongforge.benchmarks.scale.run import analyse, byte_scale
from loongforge.benchmarks.scale.report import plot, tables


def test_fit_link_recovers_alpha_beta():
    alpha, beta = 2e-4, 1 / 500e6
    pts = [(c, w, c * alpha + w * beta) for c, w in [(3, 1e6), (17, 1e6), (8, 4e6), (1, 0), (40, 2e5)]]
    a, b = ab.fit_link(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    a, b = ab.fit_link([(1, 1e6, 1e-3), (2, 1e6, 3e-3)])  # joint fit would give beta < 0
    assert a > 0 and b == 0.0


def test_fit_bytes_ring_form():
    payload = 4e6  # an all-reduce sends 2 (G-1)/G of it
    pts = [(g, 2 * (g - 1) / g * payload) for g in (1, 2, 4, 8)]
    a, b = ab.fit_bytes(pts)
    assert a == pytest.approx(2 * payload) and b == pytest.approx(0.0, abs=1e-3)
    assert ab.fit_bytes([(2, 5.0), (2, 7.0)]) == (0.0, 6.0)  # one group size: a constant


def test_projection_links_and_flag():
    fit = {"dp": {"a": 8e6, "b": 0.0, "calls": 3}, "tp": {"a": 0.0, "b": 1e6, "calls": 16}}
    hw = ab.Hardware(gpus_per_node=8, nvlink_gbps=100, nvlink_latency_us=5, ib_gbps=10, ib_latency_us=10)
    q = ab.project(fit, {"tp": 2, "sp": 2}, 32, hw, compute_s=1.0, scale={"param": 1.0, "act": 1.0})
    assert q["groups"]["tp"]["link"] == "nvlink" and q["groups"]["dp"]["link"] == "ib"
    assert q["groups"]["dp"]["group_size"] == 8
    want = 3 * 10e-6 + 8e6 * 7 / 8 / 10e9 + 16 * 5e-6 + 1e6 / 100e9
    assert q["comm_s"] == pytest.approx(want)
    assert not q["over_30pct"]
    slow = ab.project(fit, {"tp": 2, "sp": 2}, 32, hw, compute_s=1e-3, scale={"param": 1.0, "act": 1.0})
    assert slow["over_30pct"]
    inside = ab.project(fit, {"tp": 2, "sp": 2}, 8, hw, compute_s=1.0, scale={"param": 1.0, "act": 1.0})
    assert inside["groups"]["dp"]["link"] == "nvlink"  # 8 ranks fit in one node


SAME = {"measured": {"params": 100, "tp_split_params": 40, "act": 10},
        "target": {"params": 100, "tp_split_params": 40, "act": 10}}


def test_byte_scale_counts_what_one_tp_rank_holds():
    sizes = {"measured": {"params": 100, "tp_split_params": 40, "act": 10},
             "target": {"params": 1000, "tp_split_params": 800, "act": 50}}
    assert byte_scale(sizes, {"tp": 1, "sp": 1}, 4) == {"param": 10.0, "act": 5.0}
    # TP 2: a rank holds 100 - 20 = 80 measured, 1000 - 400 = 600 target parameters; bf16 halves the bytes
    # activations: x5 per sample, bf16 / 2, and the replica of 4 ranks trains 4x the samples
    assert byte_scale(sizes, {"tp": 2, "sp": 2}, 2) == {"param": pytest.approx(600 / 80 / 2), "act": 10.0}


def _row(name, plan, world, dp_bytes, tp_bytes=0.0):
    groups = {"dp": {"calls": 3, "wire_bytes": dp_bytes, "payload_bytes": dp_bytes, "seconds": 3e-3 + dp_bytes / 1e9}}
    if tp_bytes:
        groups["tp"] = {"calls": 8, "wire_bytes": tp_bytes, "payload_bytes": tp_bytes, "seconds": 8e-3 + tp_bytes / 1e9}
    comm = sum(g["seconds"] for g in groups.values())
    return {"plan_name": name, "plan": plan, "world": world, "status": "ok", "step_s": 0.1 + comm, "comm_s": comm,
            "comm_share": comm / (0.1 + comm), "wire_bytes": dp_bytes + tp_bytes, "groups": groups}


def test_analyse_report_and_plot(tmp_path):
    dp, hyb = {"tp": 1, "sp": 1, "zero": 2, "compress": 0.0}, {"tp": 2, "sp": 2, "zero": 2, "compress": 0.0}
    rows = [_row("dp", dp, n, 3 * (n - 1) / n * 1e6) for n in (1, 2, 4, 8)]
    rows += [{"plan_name": "tp2-sp2", "plan": hyb, "world": 2, "status": "skipped: world % (tp*sp) != 0"}]
    rows += [_row("tp2-sp2", hyb, n, 3 * (n // 4 - 1) / (n // 4) * 5e5, 2e6) for n in (4, 8)]
    doc = {"device": "cpu", "recipe": "tiny", "micro_batch_per_replica": 2, "load_avg": 1.0, "measured": rows,
           "projection_inputs": {"hardware": ab.Hardware().to_dict(), "recipe": "tiny", "compute_s_per_step": 2.86,
                                 "dtype_bytes": 4, "sizes": [32, 64, 128]},
           **analyse(rows, hw=ab.Hardware(), sizes=(32, 64, 128), compute_s=2.86, recipes=SAME, dtype_bytes=4)}
    assert doc["link_fit"]["alpha_s"] == pytest.approx(1e-3, rel=1e-3)  # the rows' 1 ms per call
    assert doc["link_fit"]["bandwidth_mb_s"] == pytest.approx(1000, rel=1e-3)
    assert doc["plans"]["dp"]["fit"]["dp"]["a"] == pytest.approx(3e6, rel=1e-6)
    text = tables(doc)
    assert "MEASURED" in text and "PROJECTED" in text and "skipped" in text
    assert [q["world"] for q in doc["plans"]["tp2-sp2"]["projection"]] == [32, 64, 128]
    plot(doc, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    json.dumps(doc)


@pytest.mark.slow
@pytest.mark.full
def test_bench_scale_real_runs(tmp_path):
    from loongforge.benchmarks.scale.run import run

    doc, path = run((1, 2), ["dp"], steps=3, out_dir=tmp_path, workdir=str(tmp_path / "w"))
    rows = doc["measured"]
    assert [r["world"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert rows[0]["wire_bytes"] == 0 and rows[1]["wire_bytes"] > 0  # one rank sends nothing
    assert doc["data"].startswith("synthetic shard root")
    assert path.exists() and path.with_suffix(".png").exists()


def test_scale_data_is_read_with_two_frames_per_camera(tmp_path):
    """`bench scale` trains on a synthetic shard root read with 2 frames per camera; the projection's
    recipe sizes come from that very layout."""
    from loongforge.benchmarks.harness.dataset import open_root
    from loongforge.benchmarks.scale.run import recipe_sizes, scale_data

    root, flags = scale_data(str(tmp_path), 64)
    assert open_root(root).num_frames == 64 and flags == ["--video-deltas=-1,0"]
    assert scale_data(str(tmp_path), 64) == (root, flags)  # written once per workdir
    sizes = recipe_sizes("tiny", "tiny", str(tmp_path))
    assert sizes["measured"] == sizes["target"] and sizes["measured"]["params"] > 0
