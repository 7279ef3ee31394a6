"""`loongforge train` on a root with a validation split and history deltas: 2 real gloo ranks (torchrun),
one decode worker per rank, a root written by shared/writer.py; exact resume; validation on the held-out
episodes; open-loop eval; config errors of the delta indices."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from tests.train.train_launch import assert_ok as _ok, read_metrics as _metrics, torchrun

pytestmark = pytest.mark.slow
LENGTHS = (30, 14, 41, 22, 9, 36)  # 152 samples; episode 4 (9) held out -> 143 training samples
COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "2", "--lr", "3e-3", "--zero", "2",
          "--video-deltas=-2,0", "--action-horizon", "4", "--block-run", "2", "--block-window", "32"]
STEPS = 20  # 143 // 8 = 17 steps an epoch: crosses the epoch boundary


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    from loongforge.shared.synthetic import make_synthetic_root

    work = tmp_path_factory.mktemp("split_train")
    root = str(work / "shards")
    make_synthetic_root(root, lengths=LENGTHS, height=16, width=16, block_size=8, val_episodes=(4,))
    run_dir = str(work / "run")
    proc = torchrun(2, ["--data", root, "--run-dir", run_dir, "--steps", str(STEPS), "--workers", "1",
                        "--save-every", "5", "--eval-every", "10", *COMMON], cwd=str(work), timeout=400)
    _ok(proc)
    return root, run_dir


def test_two_ranks_train_on_the_training_episodes(split_run):
    root, run_dir = split_run
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    val_ids = set(range(sum(LENGTHS[:4]), sum(LENGTHS[:5])))
    epoch0 = []
    for r in rows:
        assert r["world"] == 2 and len(r["sample_ids"][0]) == 4 and np.isfinite(r["loss"])
        a, b = (set(x) for x in r["sample_ids"])
        assert not a & b and not (a | b) & val_ids  # disjoint ranks, no held-out sample
        if r["epoch"] == 0:
            epoch0 += r["sample_ids"][0] + r["sample_ids"][1]
    assert len(epoch0) == len(set(epoch0)) == 17 * 8  # every step of epoch 0, no sample twice
    assert "val_flow_loss" in rows[9] and np.isfinite(rows[9]["val_action_mse"])


def test_resume_with_deltas_and_split_is_exact(split_run, tmp_path):
    root, run_dir = split_run
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step00000005")  # as test_deepspeed: resume from the step-5 checkpoint
    proc = torchrun(2, ["--data", root, "--run-dir", resumed, "--steps", str(STEPS), "--workers", "1", "--resume",
                        *COMMON], cwd=str(tmp_path), timeout=400)
    _ok(proc)
    want, got = _metrics(run_dir), _metrics(resumed)
    for a, b in zip(want[5:], got[5:]):
        assert a["sample_ids"] == b["sample_ids"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_open_loop_eval_of_the_held_out_episode(split_run, tmp_path):
    """`loongforge eval` of the run: the held-out episode in chunks of H from t=0, as GR00T's eval."""
    from tests.train.train_launch import launch

    root, run_dir = split_run
    out = str(tmp_path / "eval")
    proc = launch([sys.executable, "-m", "loongforge", "eval", run_dir, "--data", root, "--out", out, "--json"],
                  cwd=str(tmp_path), timeout=300)
    _ok(proc)
    summary = json.load(open(os.path.join(out, "eval.json")))
    ep = summary["episodes"]["4"]
    assert ep["chunks"] == 3 and ep["steps"] == LENGTHS[4]  # t = 0, 4, 8 of 9 frames; padded rows dropped
    assert np.isfinite(summary["overall"]["policy"]["mse"]["all"])
    assert os.path.exists(os.path.join(out, "episode_000004.png"))


def test_check_config_reads_the_root_and_refuses_bad_deltas(split_run, tmp_path):
    """Preflight reads the root (no process group); bad delta indices are config errors (exit 2)."""
    from tests.train.train_launch import launch

    root, _ = split_run
    base = [sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", str(tmp_path / "r"), "--steps", "1",
            "--check-config"]
    ok = launch([*base, *COMMON], cwd=str(tmp_path), timeout=120)
    _ok(ok)
    bad = launch([*base, *[a if a != "--video-deltas=-2,0" else "--video-deltas=0,-2" for a in COMMON]],
                 cwd=str(tmp_path), timeout=120)
    assert bad.returncode == 2 and "data.video_deltas" in bad.stderr, bad.stderr[-2000:]
