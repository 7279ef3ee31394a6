"""The fit test: the default recipe and schedule learn GR00T-shaped data on one rank.

`sample-data --preset gr00t-like --task hands` (44-D GR1 state/action, one camera; frames at
64x64 here, the tiny recipe resizes to 64 anyway): smooth arm motion that follows a target the
frames show, and binary hand commands (+-1.5 / +-3) whose switch the frames announce, the hand
joint state lagging behind. The real Beam job holds one of five episodes out; the tiny recipe
trains FIT_STEPS steps with every default (lr, warm-up + cosine schedule); `run_eval` on the
*training* episodes must then beat 0.5 x repeat-last and ridge-from-state, per the default
inference (one flow sample, the discrete-valued hands as DEFAULT_DISCRETE_MODE). The held-out
episode's table is printed beside it (reported, not asserted: one held-out episode of five).

Too slow for `make test` (minutes of CPU): `make fit` runs it (marker `full`)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.samples.dataset import PRESETS, generate_dataset
from loongforge.train.eval.baselines import DEFAULT_DISCRETE_MODE
from loongforge.train.eval.openloop import format_table, run_eval
from loongforge.train.eval.policy import Policy
from tests.train.train_launch import assert_ok, launch

pytestmark = [pytest.mark.full, pytest.mark.slow]
FIT_STEPS = int(os.environ.get("LOONGFORGE_FIT_STEPS", "400"))
BATCH = 16


@pytest.fixture(scope="module")
def fit_root(tmp_path_factory):
    base = tmp_path_factory.mktemp("fit")
    preset = {**PRESETS["gr00t-like"], "height": 64, "width": 64, "quirks": ()}
    source = generate_dataset(base / "lerobot", **preset, episodes=5, frames=(80, 120), task="hands", seed=2)
    root = str(base / "shards")
    run_job(PreprocessConfig(input=str(source), output=root, workers=1, val_count=1),
            ["--direct_running_mode=in_memory", "--direct_num_workers=1"])
    return root


@pytest.fixture(scope="module")
def fitted(fit_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("fit_run")
    run_dir = str(work / "run")
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", fit_root, "--run-dir", run_dir,
                   "--steps", str(FIT_STEPS), "--batch-size", str(BATCH), "--recipe", "tiny", "--seed", "0",
                   "--log-every", "50", "--no-ds-breakdown"], cwd=str(work), timeout=3600)
    assert_ok(proc)
    return run_dir


def test_default_recipe_fits_its_training_episodes(fit_root, fitted, tmp_path):
    policy = Policy.load(fitted, fit_root)
    held_out = list(policy.index.val_episodes)
    ids = sorted(int(e) for e in np.asarray(policy.index.ds.tables["episode_id"]))
    train = [e for e in ids if e not in held_out]
    fit = run_eval(policy, fit_root, str(tmp_path / "train"), episodes=train, samples=8)
    val = run_eval(policy, fit_root, str(tmp_path / "val"), episodes=held_out, samples=8)
    print(f"\nfit after {FIT_STEPS} steps (batch {BATCH}), training episodes {train}:\n{format_table(fit)}")
    print(f"held-out episode {held_out}:\n{format_table(val)}")
    brief = {split: {m: round(r["mse"]["all"], 4) for m, r in s["overall"].items()} for split, s in
             (("train", fit), ("val", val))}
    print("FIT-JSON " + json.dumps({"steps": FIT_STEPS, **brief}))
    mse = {m: r["mse"]["all"] for m, r in fit["overall"].items()}
    assert fit["discrete_groups"] == ["left_hand", "right_hand"]
    # what predict_action gives: the 8-sample mean, discrete-valued groups as DEFAULT_DISCRETE_MODE says
    default = {"flow": "policy_k", "snap": "snap"}[DEFAULT_DISCRETE_MODE]
    assert mse[default] < 0.5 * mse["repeat_last"], mse
    assert mse[default] < mse["ridge"], mse
