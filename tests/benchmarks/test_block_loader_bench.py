"""The block-loader benchmark's order table (benchmarks/loader/block_loader.py) on a small table: the
counted columns it reports follow the order's design (decodes per sample ~ 1/run at fleet scale); its
output table runs the loader each way it compares."""

from loongforge.benchmarks.harness.dataset import make_synthetic_root
from loongforge.benchmarks.loader.block_loader import (goals_markdown, limits, locate_cost, order_table,
                                                       output_configs, output_markdown, output_row)


def test_order_table_counts_follow_the_run_length():
    rows = {r["order"]: r for r in order_table(batch=128, episodes=150)}
    rand = rows["random permutation"]
    assert rand["decodes_per_sample"] > 0.9 and rand["distinct_blocks"] > 0.9
    for run in (2, 4, 8, 16):
        r = rows[f"run={run} window=65536"]
        assert 0.5 / run < r["decodes_per_sample"] < 2.2 / run  # a run cut by a rank slice or a group tail: 2
        assert r["distinct_blocks"] < 1.5 / run
    assert rows["run=1 window=1073741824"]["distinct_episodes"] > 0.9 * rand["distinct_episodes"]


def test_locate_cost_reports_per_id_costs():
    out = locate_cost(episodes=1000, samples=6400)
    assert out["samples"] > 1000 * 150 and out["us_per_id_batch64"] > 0 and out["searchsorted_us_per_id"] > 0


def test_output_table_times_each_output_with_and_without_recycled_buffers(tmp_path):
    make_synthetic_root(str(tmp_path), lengths=(20, 30), height=8, width=8, block_size=4)
    got = {name: output_row(str(tmp_path), 4, 3, w, rgb, recycle) for name, w, rgb, recycle in output_configs((0,))}
    # samples/CPU-s may read 0 here: a few ms of CPU, read at the clock tick of psutil
    assert len(got) == 4 and all(r["samples_per_s"] > 0 and r["samples_per_cpu_s"] >= 0 for r in got.values())
    lines = output_markdown({"output": got, "output_workers": [0]})
    assert [line.split(" | ")[1] for line in lines[2:]] == ["NV12", "float RGB"]


def test_limits_and_the_goal_verdicts(tmp_path):
    make_synthetic_root(str(tmp_path), lengths=(20, 30), height=8, width=8, block_size=4)
    got = limits(str(tmp_path), batch=4, seconds=0.05, camera="front")
    assert set(got) == {"zstd_frames_per_s", "memcpy_frames_per_s", "conversion_frames_per_s"}
    assert all(v > 0 for v in got.values())
    row = {"samples_per_s": 1000.0}
    rows = [{"gop": 250, "baseline": {"samples_per_s": 2.0}, "W=0 NV12": row, "W=0 float RGB": row,
             "W=2 NV12": {"samples_per_s": 900.0}, "W=2 float RGB": row},
            {"gop": 2, "baseline": {"samples_per_s": 40.0}, "W=0 NV12": row, "W=0 float RGB": row,
             "W=2 NV12": row, "W=2 float RGB": row}]
    lines = goals_markdown(rows)
    assert "NV12 >= 400x: met; float RGB >= 300x: met; 2 workers >= 0: MISSED" in lines[2]  # 500x; 900 < 1000
    assert "NV12 >= 40x: MISSED; float RGB >= 30x: MISSED; 2 workers >= 0: met" in lines[3]  # 25x
