"""`loongforge train` on a root with a validation split and history deltas: 2 real gloo ranks (torchrun),
one decode worker per rank, a root written by shared/writer.py; exact resume; validation on the held-out
episodes; open-loop eval; config errors of the delta indices."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from tests.train.train_launch import assert_ok as _ok
from tests.train.train_launch import read_metrics as _metrics
from tests.train.train_launch import torchrun

pytestmark = pytest.mark.slow
LENGTHS = (30, 14, 41, 22, 9, 36)  # H = 4: L - 3 samples an episode (N1.6), 134; episode 4 (6) held out -> 128
COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "2", "--lr", "3e-3", "--zero", "2",
          "--video-deltas=-2,0", "--action-horizon", "4", "--block-run", "2", "--block-window", "32"]
STEPS = 20  # 128 // 8 = 16 steps an epoch: crosses the epoch boundary


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
    per = [n - 3 for n in LENGTHS]  # samples of each episode: its chunks of 4 inside it
    val_ids = set(range(sum(per[:4]), sum(per[:5])))
    epoch0 = []
    for r in rows:
        assert r["world"] == 2 and len(r["sample_ids"][0]) == 4 and np.isfinite(r["loss"])
        a, b = (set(x) for x in r["sample_ids"])
        assert not a & b and not (a | b) & val_ids  # disjoint ranks, no held-out sample
        if r["epoch"] == 0:
            epoch0 += r["sample_ids"][0] + r["sample_ids"][1]
    assert len(epoch0) == len(set(epoch0)) == 16 * 8  # every step of epoch 0, no sample twice
    assert "val_flow_loss" in rows[9] and np.isfinite(rows[9]["val_action_mse"])


@pytest.mark.full  # exact resume is test_deepspeed.py::test_resume_is_exact; this adds deltas and a split
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
    # N1.6's samples are t = 0 .. 9-4 (whole chunks): chunks at t = 0, 4, the last frame's action in none
    assert ep["chunks"] == 2 and ep["steps"] == 8
    assert np.isfinite(summary["overall"]["policy"]["mse"]["all"])
    # one sample, the mean of --samples 8 and the ridge fitted on the training episodes
    assert {"policy", "policy_k", "ridge", "mean", "repeat_last"} <= set(summary["overall"])
    assert summary["samples"] == 8 and summary["ridge_samples"] == sum(n - 3 for n in LENGTHS) - (LENGTHS[4] - 3)
    assert os.path.exists(os.path.join(out, "episode_000004.png"))
    for noise in ("Processing zero checkpoint", "Loading checkpoint shards", "Reconstructed fp32 state dict"):
        assert noise not in proc.stdout + proc.stderr, noise  # DeepSpeed's consolidation chatter: --verbose only


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


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps 0: the flow needs at least 1"),
    (["--steps", "-3"], "--steps -3"),
    (["--episodes", "99"], "--episodes: [99] not in the shard root"),
    (["--tag", "step99999999"], "--tag step99999999: no such checkpoint"),
])
def test_eval_refuses_a_bad_request_before_loading_anything(split_run, tmp_path, capsys, monkeypatch, argv, says):
    """Exit 2 with one line, nothing written, the checkpoint never loaded (no DeepSpeed output)."""
    from loongforge.train.eval import policy

    from loongforge.cli import main

    monkeypatch.setattr(policy.Policy, "load", classmethod(lambda *a, **k: pytest.fail("checkpoint loaded")))
    root, run_dir = split_run
    out = tmp_path / "eval"
    assert main(["eval", run_dir, "--data", root, "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_eval_with_a_bad_data_root_fails_before_the_checkpoint(split_run, tmp_path, capsys, monkeypatch):
    from loongforge.train.eval import policy

    from loongforge.cli import main

    monkeypatch.setattr(policy.Policy, "load", classmethod(lambda *a, **k: pytest.fail("checkpoint loaded")))
    _, run_dir = split_run
    assert main(["eval", run_dir, "--data", str(tmp_path / "nothing")]) != 0
    assert "no index.json under" in capsys.readouterr().err


def test_policy_checks_each_observation(split_run):
    """predict_action (act is the same call) names camera, shape and width of a bad observation; a camera's
    frames at another size are taken (the processor letterboxes and resizes them as N1.6 does)."""
    from loongforge.shared.errors import ConfigError
    from loongforge.train.eval.policy import Policy

    root, run_dir = split_run
    pol = Policy.load(run_dir, root)
    ds, k = pol.index.dataset, len(pol.index.deltas.video)
    h, w = ds.height, ds.width
    good = {"frames": {s: np.zeros((k, h, w, 3), np.uint8) for s in ds.slots},
            "state": np.zeros((k, ds.state_dim), np.float32), "task": "pick"}
    assert pol.predict_action([good]).shape == (1, pol.cfg.action_horizon, ds.action_dim)
    assert pol.act == pol.predict_action or pol.act.__func__ is Policy.predict_action
    slot = ds.slots[0]
    bigger = {**good, "frames": {**good["frames"], slot: np.zeros((k, h * 2, w * 2, 3), np.uint8)}}
    assert pol.predict_action([bigger]).shape == (1, pol.cfg.action_horizon, ds.action_dim)
    bad = [
        ({**good, "frames": {s: good["frames"][s] for s in ds.slots[1:]}}, f"camera {slot!r} missing"),
        ({**good, "frames": {**good["frames"], slot: np.zeros((h, w, 3), np.uint8)}}, f"camera {slot!r} frames are"),
        ({**good, "frames": {**good["frames"], slot: np.zeros((k, h, w, 3), np.float32)}}, "expected uint8"),
        ({**good, "state": np.zeros((k, ds.state_dim - 1), np.float32)}, "state of shape"),
    ]
    for obs, says in bad:
        with pytest.raises(ConfigError, match=None) as info:
            pol.predict_action([obs])
        assert says in str(info.value), str(info.value)
