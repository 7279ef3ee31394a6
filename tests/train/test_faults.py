"""Fault handling on real multi-process DeepSpeed runs (gloo, CPU): a corrupt `latest`
checkpoint falls back to the previous one, a NaN loss never reaches the weights, a stopped
rank is detected by the heartbeat watchdog, and the elastic supervisor resumes a run on the
surviving ranks with every sample seen exactly once."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.test_ckpt_resilience import COMMON, _metrics, _ok  # noqa: E402
from tests.train.train_launch import torchrun  # noqa: E402

pytestmark = pytest.mark.slow


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


def test_corrupt_latest_falls_back_to_the_previous_checkpoint(train_root, tmp_path):
    """keep-last 1 still keeps step 2 as the fallback; a flipped byte in rank 1's optimizer partition of
    step 4 is named in a WARNING and the run resumes from step 2 (steps 2, 3 redone, none doubled)."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    args = ["--data", root, "--run-dir", run_dir, "--zero", "2", "--save-every", "2", "--keep-last", "1", *COMMON]
    _ok(torchrun(2, [*args, "--steps", "4"], cwd=str(tmp_path)))
    ckpts = os.path.join(run_dir, "checkpoints")
    assert sorted(d for d in os.listdir(ckpts) if d.startswith("step")) == ["step00000002", "step00000004"]
    bad = os.path.join(ckpts, "step00000004", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _flip_byte(bad)
    done = torchrun(2, [*args, "--steps", "6", "--resume"], cwd=str(tmp_path))
    _ok(done)
    warn = [ln for ln in done.stderr.splitlines() if "WARNING" in ln and "failed verification" in ln]
    assert warn and bad in warn[0] and "corrupt" in warn[0], done.stderr[-3000:]
    assert "resumed from step00000002 at step 2" in done.stderr
    assert [r["step"] for r in _metrics(run_dir)] == list(range(6))
    assert open(os.path.join(ckpts, "latest")).read().strip() == "step00000006"


def _module_weights(run_dir, tag):
    import torch

    from loongforge.train.checkpoint import weights_only_loads

    with weights_only_loads():
        doc = torch.load(os.path.join(run_dir, "checkpoints", tag, "mp_rank_00_model_states.pt"), weights_only=True)
    return doc["module"]


def test_nan_loss_on_one_rank_skips_the_step_on_both_and_never_reaches_the_weights(train_root, tmp_path):
    """NaN injected into rank 1's loss at steps 2 and 3 (real NaN gradients through the all-reduce). ZeRO-0,
    where nothing in DeepSpeed would catch them: the weights after step 3 are bit-identical to those after
    step 1, every weight stays finite, and metrics.jsonl counts the two skips."""
    import torch

    root, _ = train_root
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, LOONGFORGE_INJECT_NAN="2,3@1")
    done = torchrun(2, ["--data", root, "--run-dir", run_dir, "--zero", "0", "--steps", "6", "--save-every", "2",
                        *COMMON], cwd=str(tmp_path), env=env)
    _ok(done)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["nonfinite_skip"] for r in rows] == [None, None, "loss", "loss", None, None]
    assert rows[-1]["nonfinite_skips"] == 2
    w2, w4, w6 = (_module_weights(run_dir, f"step{s:08d}") for s in (2, 4, 6))
    assert all(torch.equal(w2[k], w4[k]) for k in w2)  # both skipped steps left the weights untouched
    assert all(torch.isfinite(v).all() for v in w6.values())
    assert any(not torch.equal(w4[k], w6[k]) for k in w4)  # and training went on after them


def test_nan_policy_fail_and_max_consecutive_end_the_run(train_root, tmp_path):
    from tests.train.train_launch import launch

    root, _ = train_root
    for extra, said in ((["--nan-policy", "fail"], "--nan-policy fail"),
                        (["--nan-max-consecutive", "1"], "more than --nan-max-consecutive 1 in a row")):
        run_dir = str(tmp_path / extra[0])
        env = dict(os.environ, LOONGFORGE_INJECT_NAN="1,2")
        proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, "--steps", "5",
                       *extra, *COMMON], cwd=str(tmp_path), env=env)
        assert proc.returncode == 1 and "NonFiniteLossError" in proc.stderr and said in proc.stderr, \
            proc.stderr[-3000:]
        assert [r["step"] for r in _metrics(run_dir)] == ([0] if extra[0] == "--nan-policy" else [0, 1])
