"""The trainer with `--tp`: real launches on gloo. 2 ranks x TP 2 (one data-parallel replica)
give the losses of 1 rank x TP 1 on the same global batch, step for step, in fp32, with
ZeRO-2 and ZeRO-3 (gradient clipping at 1.0 binds here, so the global gradient norm over
TP shards must be right too); a checkpoint saved in the TP layout resumes exactly. Plus
the layout checks that fail before any process group."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.train.train_launch import assert_ok as _ok, launch, read_metrics as _metrics, torchrun

from loongforge.shared.errors import CheckpointError, ConfigError  # noqa: E402

COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--steps", "4", "--no-ds-breakdown", "--dit-dropout", "0"]  # dropout masks follow the rank layout


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def tp_run(request, train_root, tmp_path_factory):
    """4 steps on 2 ranks with --tp 2, a checkpoint at step 2 and one at the end."""
    root, _ = train_root
    work = tmp_path_factory.mktemp(f"tp2_zero{request.param}")
    run_dir = str(work / "run")
    proc = torchrun(2, ["--data", root, "--run-dir", run_dir, "--zero", str(request.param), "--tp", "2",
                        "--save-every", "2", *COMMON], cwd=str(work))
    _ok(proc)
    return request.param, run_dir, proc


@pytest.mark.slow
@pytest.mark.parametrize("tp_run", [pytest.param(2, marks=pytest.mark.full), 3], ids=["zero2", "zero3"],
                         indirect=True)  # make test: TP under ZeRO-3 (ZeRO-2's TP layout is the same swap)
def test_tp2_matches_one_rank(tp_run, train_root, tmp_path):
    zero, run_dir, proc = tp_run
    root, _ = train_root
    assert "parallel plan: world=2 tp=2 sp=1 dp=1" in proc.stdout  # the placement table, rank 0 only
    assert proc.stdout.count("rank  tp  sp  dp") == 1
    ref_dir = str(tmp_path / "ref")
    _ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", ref_dir, "--zero", str(zero),
                *COMMON], cwd=str(tmp_path)))
    want, got = _metrics(ref_dir), _metrics(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(want, got, strict=True):
        assert b["tp"] == 2 and b["world"] == 2 and b["samples"] == 8
        assert b["sample_ids"] == a["sample_ids"]  # both TP ranks read the one replica's batch; one row logged
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (zero, b["step"], key)
    _check_tp_bytes(run_dir, got)
    names = sorted(os.listdir(os.path.join(run_dir, "checkpoints", "step00000004")))
    assert any("mp_rank_01" in n for n in names)  # each TP rank saved its own shards
    assert json.load(open(os.path.join(run_dir, "checkpoints", "step00000004", "loongforge.json")))["parallel"] == \
        {"tp": 2, "sp": 1}


def _check_tp_bytes(run_dir, rows):
    """Per-group accounting (metrics comm_groups, `loongforge profile`): per step, the TP group carries at
    least one all-reduce per TP-split module that runs (the row-parallel output in the forward; the
    column-parallel inputs' gradients and the q/k norm gradients add more in the backward), each counted
    once on the wire (all-reduce over 2 ranks: 2(W-1)/W = 1)."""
    import torch

    from loongforge.train.model.build import build_model
    from loongforge.train.model.config import model_config_from
    from loongforge.train.parallel.tensor_parallel import tp_modules

    doc = json.load(open(os.path.join(run_dir, "checkpoints", "step00000004", "loongforge.json")))
    with torch.device("meta"):
        modules = [n for n, _ in tp_modules(build_model(model_config_from(doc)))
                   if ".vision_model.head." not in n]  # the pooling head N1.6 never calls
    assert modules
    for r in rows:
        tp = r["comm_groups"]["tp"]
        assert tp["calls"] >= len(modules) and tp["payload_bytes"] > 0, (r["step"], tp, len(modules))
        assert tp["wire_bytes"] == tp["payload_bytes"]
    import contextlib
    import io

    from loongforge.cli import main  # `loongforge profile` in-process: one interpreter start fewer

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["profile", run_dir, "--json", "--no-chart"]) == 0
    assert json.loads(out.getvalue())["comm_groups"]["tp"]["calls"] >= len(modules)


# ZeRO-2's TP resume is `full`: make test resumes the ZeRO-3 TP run (the same layout check and per-TP-rank
# files), and test_deepspeed.py::test_resume_is_exact resumes ZeRO-2 itself.
@pytest.mark.slow
@pytest.mark.parametrize("tp_run", [pytest.param(2, marks=pytest.mark.full), 3], ids=["zero2", "zero3"],
                         indirect=True)
def test_tp2_resume_is_exact(tp_run, train_root, tmp_path):
    """4 steps straight == 2 steps + resume (same layout) + 2 steps."""
    zero, run_dir, _ = tp_run
    root, _ = train_root
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step00000002")
    _ok(torchrun(2, ["--data", root, "--run-dir", resumed, "--zero", str(zero), "--tp", "2", "--resume", *COMMON],
                 cwd=str(tmp_path)))
    want, got = _metrics(run_dir), _metrics(resumed)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(want[2:], got[2:], strict=True):
        assert b["sample_ids"] == a["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)


def test_layout_checked_before_any_group(train_root, monkeypatch):
    from loongforge.train.config import ParallelConfig
    from loongforge.train.flags import add_train_args, config_from_args
    from loongforge.train.preflight import preflight

    root, _ = train_root
    import argparse

    p = argparse.ArgumentParser()
    add_train_args(p)
    cfg = config_from_args(p.parse_args(["--data", root, "--run-dir", "r", "--tp", "2"]))
    assert cfg.parallel.tp == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="not divisible by tp"):
        preflight(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preflight(cfg).ds_config["train_micro_batch_size_per_gpu"] == 8  # one replica reads all 8
    cfg8 = config_from_args(p.parse_args(["--data", root, "--run-dir", "r", "--tp", "8"]))
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="heads"):  # the tiny recipe has 4 heads
        preflight(cfg8)
    monkeypatch.setenv("WORLD_SIZE", "2")
    fp8 = config_from_args(p.parse_args(["--data", root, "--run-dir", "r", "--tp", "2", "--fp8"]))
    with pytest.raises(ConfigError, match="--fp8"):  # the TP swap would drop the FP8 linears
        preflight(fp8)
    with pytest.raises(ConfigError, match="parallel.sp"):
        ParallelConfig(sp=0)
    with pytest.raises(ConfigError, match="parallel.tp"):
        ParallelConfig(tp=0)


def test_resume_refuses_another_layout():
    from loongforge.train.parallel.plan import ParallelPlan, ParallelState
    from loongforge.train.ckpt.checkpoint import check_resume_layout

    state = ParallelState(ParallelPlan(tp=2), {}, {})
    check_resume_layout({"parallel": {"tp": 2, "sp": 1}}, state, "step00000002")
    with pytest.raises(CheckpointError, match="tp=1 sp=1.*ckpt reshard.*same --tp"):
        check_resume_layout({}, state, "step00000002")  # written before --tp existed: TP 1
    with pytest.raises(CheckpointError, match="another rank count.*loongforge ckpt reshard RUN --to world=2,zero=2,tp=2"):
        check_resume_layout({"parallel": {"tp": 2, "sp": 1}, "world": 4}, state, "step00000002", world=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp_run", [3], ids=["zero3"], indirect=True)
def test_tp_checkpoint_exports_after_a_reshard_to_tp1(tp_run, train_root, tmp_path, capsys):
    """Export reads whole tensors: a TP-2 checkpoint is refused with the converting command, which then
    gives a ZeRO-0 TP-1 copy that exports with the reference's tensor names. (The commands in this process:
    `loongforge export` and `ckpt reshard` as processes are test_gr00t_checkpoint's and test_ckpt_reshard's.)"""
    from loongforge.cli import main

    _, run_dir, _ = tp_run
    root, _ = train_root
    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    export = ["export", run, str(tmp_path / "out"), "--data", root]
    capsys.readouterr()
    assert main(export) != 0
    err = capsys.readouterr().err
    assert "tensor-parallel shards" in err, err[-2000:]
    cmd = err.split("first: ", 1)[1].split()  # loongforge ckpt reshard RUN --tag T --to world=1,zero=0,tp=1
    assert main(cmd[1:]) == 0
    assert main(export) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "backbone.model.language_model.model.layers.0.self_attn.q_proj.weight" in names
