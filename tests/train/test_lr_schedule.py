"""The LR schedule: its curve, its flags and config, its checkpoint state, and an exact 1-rank resume."""

import glob
import io
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.train.ckpt.reshard_io import target_meta
from loongforge.train.config import RECIPE_LR, OptimConfig
from loongforge.train.flags import add_train_args, config_from_args
from loongforge.train.parallel.lr_schedule import LRSchedule, lr_factor
from tests.train.train_launch import assert_ok, launch, read_metrics


def _curve(kind, warmup, total, min_ratio=0.0):
    return [lr_factor(k, kind=kind, warmup=warmup, total=total, min_ratio=min_ratio) for k in range(total)]


def test_warmup_then_cosine_linear_constant():
    cos = _curve("cosine", 4, 20)
    assert cos[:4] == [0.25, 0.5, 0.75, 1.0]  # the first update already moves; update W-1 is at the peak
    assert cos[4] == 1.0 and cos[12] == pytest.approx(0.5)  # halfway through the decay
    assert all(a > b for a, b in zip(cos[4:], cos[5:])) and cos[-1] < 0.01
    lin = _curve("linear", 4, 20, min_ratio=0.1)
    assert lin[12] == pytest.approx(0.1 + 0.9 * 0.5) and lin[-1] > 0.1
    assert lr_factor(10**6, kind="linear", warmup=4, total=20, min_ratio=0.1) == pytest.approx(0.1)  # past the end
    assert _curve("constant", 2, 6) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert _curve("cosine", 0, 3)[0] == 1.0  # no warm-up


def test_config_warmup_and_validation():
    assert OptimConfig().warmup_for(1000) == 50 and OptimConfig().warmup_for(4) == 1  # ratio 0.05, rounded up
    assert OptimConfig(warmup_steps=7).warmup_for(1000) == 7
    for bad in ({"lr_schedule": "step"}, {"warmup_ratio": 1.0}, {"warmup_steps": -1}, {"min_lr_ratio": 2.0}):
        with pytest.raises(ConfigError):
            OptimConfig(**bad)


def _args(*extra):
    import argparse

    p = argparse.ArgumentParser()
    add_train_args(p)
    return p, ["--data", "/x", "--run-dir", "/y", *extra]


def test_flags_recipe_lr_and_schedule_flags(capsys):
    p, base = _args()
    assert config_from_args(p.parse_args(base)).optim.lr == RECIPE_LR["tiny"]
    assert config_from_args(p.parse_args([*base, "--recipe", "small"])).optim.lr == RECIPE_LR["small"]
    o = config_from_args(p.parse_args([*base, "--recipe", "small", "--lr", "5e-4", "--lr-schedule", "linear",
                                       "--warmup-steps", "10", "--weight-decay", "0.01", "--grad-clip", "0.5"])).optim
    assert (o.lr, o.lr_schedule, o.warmup_steps, o.weight_decay, o.grad_clip) == (5e-4, "linear", 10, 0.01, 0.5)
    with pytest.raises(SystemExit) as e:
        p.parse_args([*base, "--warmup-steps", "3", "--warmup-ratio", "0.1"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_state_round_trips_weights_only_and_rejects_another_version():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    s = LRSchedule(opt, OptimConfig(lr=2e-3, warmup_steps=2), total_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # set before the first update
    for _ in range(5):
        s.step()
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    s2 = LRSchedule(opt2, OptimConfig(lr=2e-3, warmup_steps=2), total_steps=10)
    s2.load_state_dict(state)
    assert s2.loaded and s2.updates == 5 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(CheckpointError, match="not version"):
        s2.load_state_dict({"last_batch_iteration": 3})
    s3 = LRSchedule(opt2, OptimConfig(lr=2e-3, warmup_steps=2), total_steps=10)
    s3.load_state_dict(None)  # a checkpoint from before: left to the trainer's fast-forward
    assert not s3.loaded and s3.updates == 0
    s3.fast_forward(5)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


ARGS = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
        "--warmup-steps", "3", "--no-ds-breakdown", "--zero", "2", "--steps", "8"]


@pytest.fixture(scope="module")
def schedule_run(train_root, tmp_path_factory):
    """8 steps straight on one rank, a checkpoint at step 4: the lr on the warm-up + cosine curve."""
    root, _ = train_root
    work = tmp_path_factory.mktemp("schedule")
    run_dir = str(work / "run")
    cmd = [sys.executable, "-m", "loongforge.train", "--data", root, *ARGS]
    assert_ok(launch([*cmd, "--run-dir", run_dir, "--save-every", "4"], cwd=str(work)))
    want = read_metrics(run_dir)
    expect = [3e-3 * lr_factor(k, kind="cosine", warmup=3, total=8, min_ratio=0.0) for k in range(8)]
    assert [r["lr"] for r in want] == pytest.approx(expect, rel=1e-6)
    saved = glob.glob(os.path.join(run_dir, "checkpoints", "step00000004", "mp_rank_00_model_states.pt"))
    assert torch.load(saved[0], weights_only=True)["lr_scheduler"]["updates"] == 4
    return run_dir, want


@pytest.mark.slow
def test_one_rank_resume_continues_the_schedule_exactly(schedule_run, train_root, tmp_path):
    """8 steps straight == 4 steps + resume + 4: the same lr and loss at every step, on the curve."""
    run_dir, want = schedule_run
    root, _ = train_root
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step00000004")
    cmd = [sys.executable, "-m", "loongforge.train", "--data", root, *ARGS]
    assert_ok(launch([*cmd, "--run-dir", resumed, "--resume"], cwd=str(tmp_path)))
    got = read_metrics(resumed)
    assert [r["step"] for r in got] == list(range(8))
    for a, b in zip(want[4:], got[4:]):
        assert b["lr"] == a["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


# Two more launches (~13 s); make test keeps the schedule state's reshard rule as a unit test
# (test_reshard_carries_the_schedule_state) and the resume above.
@pytest.mark.slow
@pytest.mark.full
def test_the_schedule_goes_on_across_a_reshard(schedule_run, train_root, tmp_path):
    """`ckpt reshard` (ZeRO-2 -> ZeRO-3), then resume: the schedule goes on at update 4, not from a new warm-up."""
    run_dir, want = schedule_run
    root, _ = train_root
    moved = str(tmp_path / "resharded")
    shutil.copytree(run_dir, moved)
    assert_ok(launch([sys.executable, "-m", "loongforge", "ckpt", "reshard", moved, "--tag", "step00000004",
                      "--to", "world=1,zero=3"], cwd=str(tmp_path)))
    args = [a if a != "2" or ARGS[i - 1] != "--zero" else "3" for i, a in enumerate(ARGS)]
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, *args, "--run-dir", moved,
                      "--resume"], cwd=str(tmp_path)))
    again = read_metrics(moved)
    assert [r["step"] for r in again] == list(range(8)) and again[4]["warmup"]  # steps 4.. ran again, here
    assert [r["lr"] for r in again[4:]] == [r["lr"] for r in want[4:]]


def test_reshard_carries_the_schedule_state():
    """`ckpt reshard` writes the target's model-states metadata from the source's: the schedule goes along."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    s = LRSchedule(opt, OptimConfig(lr=1e-3), total_steps=100)
    for _ in range(9):
        s.step()
    out = target_meta({"lr_scheduler": s.state_dict(), "ds_version": "0", "param_shapes": []},
                      SimpleNamespace(dp=3, tp=1))
    assert out["lr_scheduler"] == s.state_dict() and out["lr_scheduler"]["updates"] == 9
