"""Fixtures of the trainer tests: synthetic shard roots and a helper that runs
a real multi-process launch (helpers in train_launch.py)."""

from __future__ import annotations

import os
import sys

import pytest

# The launch helpers (train_launch.py) sit beside this file; put it on sys.path explicitly so the
# test files' imports work under pytest's default (prepend) and --import-mode=importlib alike.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


TRAIN_LENGTHS = (20, 12, 18, 14)  # 64 samples at stride 1: 8 global batches of 8 an epoch, no tail
# H = 1 (the recorded default; --action-horizon overrides): every sample's action rows are real. With
# H > 1 the last H-1 samples of an episode carry padded rows (action_valid False); the loss is still
# the global batch's mean over its valid rows whatever the split (test_split_equivalence.py trains
# with H = 4 on this root), and test_train_split_eval.py trains with H = 4 too.
TRAIN_HORIZON = 1


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(tmp_path_factory):
    """The session's fork server (train_launch.WARM, started by the first launch that uses it): ranks of
    launch()/torchrun() are forked from it, their imports done once for the session instead of once per rank
    (the elastic supervisor's own mechanism, resilience/elastic/forks.py). LOONGFORGE_WARM=0 runs every rank
    as a fresh interpreter."""
    from tests.train import train_launch

    train_launch.WARM["log"] = str(tmp_path_factory.mktemp("warm") / "log")
    yield
    server, train_launch.WARM["server"], train_launch.WARM["log"] = train_launch.WARM["server"], None, None
    if server:
        server.close()


@pytest.fixture(scope="session")
def train_root(tmp_path_factory):
    """4 episodes (64 samples), one per shard, 2 cameras, 16x16 frames, blocks of 4 frames, H = 1.
    Returns (root, the TrainingData the trainer sees with the default delta indices)."""
    from loongforge.shared.synthetic import make_synthetic_root
    from loongforge.train.config import DataConfig
    from loongforge.train.data.training_data import load_training_data

    from tests.conftest import once_per_session

    root = str(once_per_session(tmp_path_factory, "train_root", lambda d: make_synthetic_root(
        str(d), lengths=TRAIN_LENGTHS, shard_size=1, action_horizon=TRAIN_HORIZON)))
    return root, load_training_data(DataConfig(root=root))


@pytest.fixture(scope="session")
def zero3_run(train_root, tmp_path_factory):
    """One plain 2-rank ZeRO-3 run (4 steps, a checkpoint every 2) that several files inspect:
    test_ckpt_resilience resumes it on 1 rank, test_compressed_dp_train compares --grad-compression
    against its losses. A launch costs ~20 CPU s; tests read this run and write only to copies."""
    from tests.conftest import once_per_session
    from tests.train.train_launch import torchrun

    root, _ = train_root

    def make(work):
        proc = torchrun(2, ["--data", root, "--run-dir", str(work / "run"), *ZERO3_RUN_ARGS], cwd=str(work),
                        timeout=400)
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    return str(once_per_session(tmp_path_factory, "zero3_run", make) / "run")


ZERO3_RUN_ARGS = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
                  "--no-ds-breakdown", "--steps", "4", "--zero", "3", "--save-every", "2", "--dit-dropout", "0"]


@pytest.fixture(scope="session")
def ac_fp8_zero3_launch(train_root, tmp_path_factory):
    """ac_zero3_worker.py on 2 ranks, both checks in one launch (~20 CPU s each): test_ac.py reads its
    AC-ZERO3-OK lines, test_precision.py its FP8-ZERO3-OK lines."""
    import json
    import os
    import subprocess

    from tests.conftest import once_per_session
    from tests.train.train_launch import torchrun_script

    root, _ = train_root
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ac_zero3_worker.py")

    def make(work):  # what the tests read of the launch, kept for the session's other workers
        proc = torchrun_script(2, worker, [root, str(work / "run"), "ac", "fp8"], cwd=str(work), timeout=600)
        (work / "launch.json").write_text(json.dumps([proc.args, proc.returncode, proc.stdout, proc.stderr]))

    args, rc, out, err = json.loads((once_per_session(tmp_path_factory, "ac_zero3", make) / "launch.json").read_text())
    return subprocess.CompletedProcess(args, rc, out, err)
