"""`loongforge bench ablation`: the ladder's structure (pure), the report arithmetic on
synthetic rank records, the ordering block's coverage count, and the `--quick` variant end
to end (real generator, real preprocess, real trainer ranks on gloo). No speed thresholds:
the quick run must produce the table and phases that add up to the step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from loongforge.benchmarks.ablation import report
from loongforge.benchmarks.ablation.order import epoch_coverage
from loongforge.benchmarks.ablation.rows import OPTIMIZATIONS, Plan, Setting, ladder, train_argv

QUICK_BUDGET_S = 600  # < 90 s on an idle 2-core machine; the margin absorbs a loaded one


def test_ladder_has_baseline_cumulative_then_alone_in_the_seed_order():
    rows = ladder(Plan(ranks=4, cuda=False, sp_accepted=False))
    assert [r.id for r in rows][:1] == ["0"] and rows[0].setting == Setting()
    cum = [r for r in rows if r.block == "cumulative"]
    alone = [r for r in rows if r.block == "alone"]
    assert [r.label for r in cum] == [o.label for o in OPTIMIZATIONS]
    assert len(alone) == len(OPTIMIZATIONS) - 1  # shards alone is C1
    # cumulative: each runnable row keeps everything the previous rows switched on
    assert cum[-1].setting.loader == "shards" and cum[-1].setting.cache and cum[-1].setting.prefetch
    assert cum[-1].setting.tp == 2 and cum[-1].setting.zero == 3 and cum[-1].setting.compression
    assert cum[-1].setting.ac_every and cum[-1].setting.batch_scale == 2
    # alone: one change on top of row 0 (the data rows need the shard loader)
    comp = next(r for r in alone if "compression" in r.label)
    assert comp.setting.loader == "pyav" and comp.setting.compression and comp.setting.tp == 1


def test_gpu_only_rows_say_needs_gpu_on_cpu_and_run_on_cuda():
    cpu = ladder(Plan(ranks=4, cuda=False, sp_accepted=False))
    skipped = {r.id for r in cpu if r.skip and r.skip.startswith("needs GPU")}
    assert skipped == {"C7", "C9", "A7", "A9"}
    assert all(r.setting.precision == "fp32" and not r.setting.fp8 for r in cpu)  # nothing GPU-only leaks on
    gpu = ladder(Plan(ranks=4, cuda=True, sp_accepted=False))
    assert not any(r.skip for r in gpu) and gpu[-1].setting.fp8 is False  # A10 is batch alone
    assert next(r for r in gpu if r.id == "C10").setting.fp8


def test_hybrid_row_uses_sp_only_when_the_trainer_takes_it_and_says_so():
    no_sp = ladder(Plan(ranks=8, cuda=False, sp_accepted=False))
    c4 = next(r for r in no_sp if r.id == "C4")
    assert (c4.setting.tp, c4.setting.sp) == (2, 1) and "refuses --sp" in c4.note
    with_sp = ladder(Plan(ranks=8, cuda=False, sp_accepted=True))
    c4 = next(r for r in with_sp if r.id == "C4")
    assert (c4.setting.tp, c4.setting.sp) == (2, 2) and "dp 2" in c4.note
    assert "--sp" in train_argv(c4.setting, shards="s", run_dir="r", recipe="tiny", batch=8, steps=3, seed=0,
                                cuda=False, cache_socket=None)
    two = ladder(Plan(ranks=2, cuda=False, sp_accepted=True))  # TP 2 leaves no DP replica to compress across
    assert next(r for r in two if r.id == "C5").skip.startswith("needs >= 2 data-parallel")


def test_zero3_rows_fetch_blocks_whole_through_the_trainer_flag():
    """The ZeRO-3 rows run what a user of a small model sets: DeepSpeed leaf modules for the
    transformer blocks (--zero3-leaf-blocks), reaching the DeepSpeed JSON with class names
    DeepSpeed resolves; the ZeRO-2 rows leave it off."""
    import argparse

    import torch

    from loongforge.train.parallel.engine import ds_config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    from transformers.models.siglip2.modeling_siglip2 import Siglip2EncoderLayer

    from loongforge.train.flags import add_train_args, config_from_args
    from loongforge.train.model.dit import BasicTransformerBlock

    rows = {r.id: r for r in ladder(Plan(ranks=4, cuda=False, sp_accepted=True))}
    p = argparse.ArgumentParser()
    add_train_args(p)
    leaves = {}
    for rid in ("C4", "A5", "C3", "0"):
        argv = train_argv(rows[rid].setting, shards="s", run_dir="r", recipe="tiny", batch=8, steps=3, seed=0,
                          cuda=False, cache_socket=None)
        conf = ds_config(config_from_args(p.parse_args(argv)), world=2, device=torch.device("cpu"))
        leaves[rid] = conf["zero_optimization"].get("leaf_module")
    assert leaves["C3"] is None and leaves["0"] is None  # ZeRO-2 rows
    names = {f"{c.__module__}.{c.__qualname__}" for c in (Siglip2EncoderLayer, Qwen3DecoderLayer,
                                                          BasicTransformerBlock)}  # how DeepSpeed matches
    assert set(leaves["C4"]["classes"]) == names and set(leaves["A5"]["classes"]) == names


def _rank_doc(steps, wait=0.1, comm=0.02, over=0.005, comp=0.2, tp_comm=0.0):
    recs = [{"step_s": wait + comm + tp_comm + over + comp, "data_wait_s": wait, "comm_s": comm, "overhead_s": over,
             "forward_s": comp / 2 + tp_comm, "backward_s": comp / 2 + comm, "optimizer_s": 0.0,
             "comm_groups": {"tp": {"seconds": tp_comm}, "dp": {"seconds": comm}}} for _ in range(steps)]
    return {"records": recs, "saved_bytes": 1 << 20, "losses": [1.0] * steps}


def test_breakdown_counts_tp_collectives_and_reads_the_critical_rank():
    # rank 0 is late on data (0.3 s); rank 1 waits for it inside the all-reduce (0.32 s of "comm")
    run = report.summarise_run([_rank_doc(3, wait=0.3, comm=0.02), _rank_doc(3, wait=0.0, comm=0.32)])
    assert run["data_wait_s"] == pytest.approx(0.3) and run["comm_s"] == pytest.approx(0.02)
    assert run["rank_mean"]["comm_s"] == pytest.approx(0.17)
    # TP collectives run outside DeepSpeed's timers: the group counter adds them to exposed comm
    tp = report.summarise_run([_rank_doc(2, comm=0.01, tp_comm=0.05)])
    assert tp["comm_s"] == pytest.approx(0.06) and tp["compute_s"] == pytest.approx(0.2)  # dp 0.01 + tp 0.05
    assert tp["phase_sum_error"] < 1e-9


def test_report_phases_add_up_and_speedup_is_samples_per_second():
    base = report.summarise_run([_rank_doc(3, wait=0.2), _rank_doc(3, wait=0.2)])
    assert base["data_wait_s"] == pytest.approx(0.2) and base["phase_sum_error"] < 1e-9
    rows = ladder(Plan(ranks=2, cuda=False, sp_accepted=False), quick=True)
    fast = report.summarise_run([_rank_doc(3, wait=0.001)] * 2)
    doc = report.build_doc(cfg={"batch": 8}, plan={}, rows=rows, device="cpu",
                           measured={"runs": {"0": [base], "C1": [fast]}, "errors": {}})
    r0, r1 = doc["rows"]
    assert r1["speedup"] == pytest.approx(r0["step_s"]["median"] / r1["step_s"]["median"])
    assert doc["goals"]["data_wait_met"] and not doc["goals"]["speedup_met"]  # 0.425 s -> 0.226 s is 1.9x
    table = report.markdown_table(doc)
    assert "\n| 0 | baseline" in table and "\n| C1 | offline" in table and "missed" in table


def test_epoch_coverage_counts_duplicates_and_never_seen():
    train = np.arange(8)
    good = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # 2 steps x 2 ranks x 2 samples = one epoch
    bad = [[[0, 1], [0, 2]], [[4, 5], [4, 1]]]
    assert epoch_coverage(good, train, 2)[0] | {} == {"epoch": 0, "trained": 8, "distinct": 8, "duplicated": 0,
                                                       "never_seen": 0, "train_samples": 8}
    e = epoch_coverage(bad, train, 2)[0]
    assert (e["duplicated"], e["never_seen"]) == (3, 3)


# ~32 s of the real trainer on 1 rank; make test keeps the baseline row's sample identity tests above,
# `make test-full` runs this (the `--quick` ladder end to end).
@pytest.mark.slow
@pytest.mark.full
def test_quick_ablation_produces_a_consistent_table(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "loongforge", "bench", "ablation", "--quick", "--out",
                           str(tmp_path / "out"), "--workdir", str(tmp_path / "work")], capture_output=True,
                          text=True, timeout=QUICK_BUDGET_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| 0 | baseline" in proc.stdout and "| C1 | offline shards" in proc.stdout
    doc = json.loads((tmp_path / "out" / "ablation-quick.json").read_text())
    assert [r["status"] for r in doc["rows"]] == ["ok", "ok"]
    for r in doc["rows"]:
        assert r["phase_sum_error"] < 0.02, r
        total = sum(r["phases_s"].values())
        assert abs(total - r["step_s"]["median"]) / r["step_s"]["median"] < 0.02  # the median repeat's phases
        assert r["saved_bytes"] > 0 and r["samples_per_s"] > 0
    assert doc["rows"][1]["speedup"] > 0 and (tmp_path / "out" / "ablation-quick.png").exists()
    print(f"quick ablation wall {wall:.0f} s, load {os.getloadavg()}")


@pytest.fixture(scope="module")
def shard_root(lerobot_root, tmp_path_factory):
    """The conftest's LeRobot dataset through the real `loongforge preprocess`."""
    from loongforge.benchmarks.harness.config import BenchConfig
    from loongforge.benchmarks.harness.data import transcode

    cfg = BenchConfig(episodes=2, episode_frames=(150, 160), height=32, width=32, gop=100, gops=(100,),
                      shard_size="1MB", preprocess_workers=1)
    out = tmp_path_factory.mktemp("ablation") / "shards"
    transcode(cfg, lerobot_root, out)
    return str(out)


def _trainer_loader(shards: str, rank: int, world: int):
    """The loader a trainer rank of a ladder row builds: the row's `loongforge train` arguments, parsed."""
    import argparse

    from loongforge.train.data.training_data import load_training_data, make_loader
    from loongforge.train.flags import add_train_args, config_from_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    argv = train_argv(Setting(), shards=shards, run_dir="unused", recipe="tiny", batch=8, steps=12, seed=0,
                      cuda=False, cache_socket=None)
    d = config_from_args(p.parse_args(argv)).data
    return make_loader(d, load_training_data(d), batch_size=8, rank=rank, world=world, device="cpu")


def test_baseline_row_serves_the_fast_paths_samples_in_its_order(lerobot_root, shard_root):
    """Row 0's on-the-fly PyAV loader and the trainer's loader of the same row, rank 1 of 2: per step the
    same sample ids (the global order, this rank's slice, across the epoch boundary) and the same samples:
    K=4 frames at deltas -3..0 (clamped at an episode start) every 4th t, state, action chunk and its
    validity, task tokens; frames equal up to the transcode's NV12 round trip."""
    from itertools import islice

    from loongforge.benchmarks.ablation.rank import BaselineLoader

    steps = 12  # an epoch is ~78 samples / 8 = 9 steps: the plan rolls over inside this run
    with _trainer_loader(shard_root, 1, 2) as fast:
        assert fast.deltas.video == (-3, -2, -1, 0) and fast.stride == 4
        ours = list(islice(fast, steps))
    base = BaselineLoader(_trainer_loader(shard_root, 1, 2), str(lerobot_root), num_workers=0, steps=steps)
    try:
        theirs = list(islice(iter(base), steps))
    finally:
        base.close()
    assert {b["meta"]["epoch"] for b in ours} == {0, 1}
    for a, b in zip(ours, theirs, strict=True):
        assert a["meta"]["sample_ids"].tolist() == b["meta"]["sample_ids"].tolist() == b["sample_ids"].tolist()
        assert (a["meta"]["epoch"], a["meta"]["consumed"]) == (b["meta"]["epoch"], b["meta"]["consumed"])
        for key in ("state", "action"):
            torch_close(a[key], b[key], 1e-5)
        for key in ("action_valid", "frame_mask", "task_tokens", "task_mask", "sample_valid"):
            assert a[key].tolist() == b[key].tolist(), key
        for slot, frames in a["frames"].items():
            assert frames.shape == b["frames"][slot].shape
            assert float((frames - b["frames"][slot]).abs().mean()) < 0.15  # 0.04 of the RGB range, std 0.25
    assert base.state_dict()["consumed"] == fast.state_dict()["consumed"]  # the inner loader's state follows


def torch_close(a, b, atol: float) -> None:
    import torch

    assert torch.allclose(a.float(), b.float(), atol=atol), float((a.float() - b.float()).abs().max())
