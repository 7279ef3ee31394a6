"""The trainer with `--grad-compression topk` (hybrid sharding: ZeRO-3 inside the SP group, top-k +
error feedback across the DP replicas between backward and step), real launches on 2 gloo ranks:
at --compress-ratio 1 every bucket falls back to the dense all-reduce and the run equals plain
ZeRO-3 data parallel step for step; at the default ratio 3 the DP group carries 1/3 of the dense
bytes (metrics comm_groups), and a resume restores each rank's residuals exactly."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import torchrun  # noqa: E402

from loongforge.shared.errors import ConfigError  # noqa: E402

COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--steps", "4", "--zero", "3", "--no-ds-breakdown", "--dit-dropout", "0"]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(root, run_dir, *extra, cwd):
    proc = torchrun(2, ["--data", root, "--run-dir", run_dir, *COMMON, *extra], cwd=cwd)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _decisions(stdout: str) -> list[tuple[int, int, str]]:
    """The cost model's table, printed once by rank 0: (n, k, path) per bucket."""
    rows = re.findall(r"^\s*\d+\s+(\d+)\s+(\d+)\s+(sparse|dense)\s+\d+\s+\d+\s*$", stdout, re.M)
    return [(int(n), int(k), path) for n, k, path in rows]


@pytest.fixture(scope="module")
def topk_run(train_root, tmp_path_factory):
    root, _ = train_root
    work = tmp_path_factory.mktemp("topk")
    run_dir = str(work / "run")
    proc = _run(root, run_dir, "--grad-compression", "topk", "--save-every", "2", cwd=str(work))
    return run_dir, proc


@pytest.mark.slow
@pytest.mark.full  # ~22 s: make test keeps test_topk_sends_a_third_and_resumes_exactly on the same code path
def test_ratio_one_equals_plain_zero3(train_root, zero3_run, tmp_path):
    root, _ = train_root
    # zero3_run (tests/train/conftest.py) is this file's COMMON run plain (plus checkpoints, which
    # change no loss): one launch fewer.
    plain, dense = zero3_run, str(tmp_path / "dense")
    proc = _run(root, dense, "--grad-compression", "topk", "--compress-ratio", "1", cwd=str(tmp_path))
    assert [d[2] for d in _decisions(proc.stdout)] == ["dense"]  # ratio 1: sparse never wins
    want, got = _metrics(plain), _metrics(dense)
    for a, b in zip(want, got, strict=True):
        assert b["sample_ids"] == a["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), b["step"]
        assert "dp" in b["comm_groups"] and "sp" in b["comm_groups"]  # ZeRO-3 inside sp, the sync over dp


@pytest.mark.slow
def test_topk_sends_a_third_and_resumes_exactly(topk_run, train_root, tmp_path):
    run_dir, proc = topk_run
    root, _ = train_root
    rows = _metrics(run_dir)
    for r in rows:
        dp = r["comm_groups"]["dp"]
        assert dp["calls"] == 1  # one bucket: one all-gather of [values | indices]
    # The decision table printed once on rank 0: n parameters, k kept; bytes on the wire follow from them.
    [(n, k, path)] = _decisions(proc.stdout)
    assert path == "sparse" and rows[0]["comm_groups"]["dp"]["wire_bytes"] == k * 8  # (W-1) k (4 + 4)
    assert k * 8 <= (2 * (2 - 1) / 2 * n * 4) / 3 + 8  # 1/3 of the dense all-reduce
    losses = [r["loss"] for r in rows]
    assert all(0 < v < 10 for v in losses)
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    assert os.path.exists(os.path.join(resumed, "checkpoints", "step00000002", "compressor_rank1.pt"))
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step00000002")
    _run(root, resumed, "--grad-compression", "topk", "--resume", cwd=str(tmp_path))
    for a, b in zip(rows[2:], _metrics(resumed)[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)  # residuals restored per rank


def test_compression_config_checked():
    from loongforge.train.config import ParallelConfig

    with pytest.raises(ConfigError, match="--zero 3"):
        ParallelConfig(grad_compression="topk", zero_stage=2)
    with pytest.raises(ConfigError, match="compress_ratio"):
        ParallelConfig(grad_compression="topk", zero_stage=3, compress_ratio=0.5)
    assert ParallelConfig(grad_compression="topk", zero_stage=3).compress_ratio == 3.0


@pytest.mark.slow
def test_plain_zero3_gradient_traffic_is_reported_under_dp(zero3_run):
    """Plain ZeRO-3 over 2 ranks is data parallel over the world: its gathers and reduce-scatters are
    the DP traffic and carry the group name the compressed sync's traffic has (`loongforge profile`)."""
    for r in _metrics(zero3_run):
        groups = r["comm_groups"]
        assert "world" not in groups, groups
        assert groups["dp"]["payload_bytes"] > 0 and groups["dp"]["calls"] >= 2, groups


@pytest.mark.slow
@pytest.mark.full  # top-k's own path is test_topk_sends_a_third_and_resumes_exactly; the warm-up is its schedule
def test_dense_warmup_steps_then_top_k(train_root, zero3_run, tmp_path):
    """--compress-warmup-steps 2: steps 0-1 sync dense (the plain run's losses through step 2, whose
    forward sees their weights), then top-k (a third of the bytes)."""
    root, _ = train_root
    run_dir = str(tmp_path / "warm")
    _run(root, run_dir, "--grad-compression", "topk", "--compress-warmup-steps", "2", cwd=str(tmp_path))
    plain, got = _metrics(zero3_run), _metrics(run_dir)
    for a, b in zip(plain[:3], got[:3], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), b["step"]
    wire = [r["comm_groups"]["dp"]["wire_bytes"] for r in got]
    assert wire[0] == wire[1] and all(w * 2.5 < wire[0] for w in wire[2:]), wire


def test_warmup_steps_need_topk():
    from loongforge.train.config import ParallelConfig

    with pytest.raises(ConfigError, match="compress_warmup_steps"):
        ParallelConfig(zero_stage=3, compress_warmup_steps=5)
