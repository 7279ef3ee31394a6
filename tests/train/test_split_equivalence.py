"""The result of training does not depend on how a global batch is split: real launches on gloo with
action horizon 4, so the samples near an episode's end carry padded action rows (action_valid False)
and different ranks / micro-batches hold different numbers of valid rows. DP 2, 1 rank with
--grad-accum 2 and DP 2 x TP 2 each equal 1 rank over 8 steps, within 1e-5 relative: the logged
losses (the global mean over valid rows) and the optimizer state (fp32 master weights, both Adam
moments, read after `ckpt reshard` to one rank; relative to each kind's norm). `full`: DP 2 x TP 2,
ZeRO-3 and the compressed sync at DP 2, and DP 2 resumed on 1 rank after `ckpt reshard`."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from tests.train.conftest import TRAIN_LENGTHS
from tests.train.train_launch import assert_ok, launch, read_metrics, torchrun

HORIZON = 4
STEPS = 8
COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--no-ds-breakdown", "--steps", str(STEPS), "--action-horizon", str(HORIZON), "--zero", "2",
          "--dit-dropout", "0",  # the DiT's dropout masks follow the rank layout
          "--lr-schedule", "constant", "--warmup-steps", "1"]  # a run of 4 steps resumed to 8 has the 8-step lr
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def valid_rows(sample_ids) -> int:
    """Valid action rows of these samples (samples.action_rows: the H rows from t, real while < length)."""
    from loongforge.train.data.samples import DeltaSpec, SampleTable, action_rows

    table, spec = SampleTable(np.asarray(TRAIN_LENGTHS)), DeltaSpec(action_horizon=HORIZON)
    eps, ts = table.locate(np.asarray(sample_ids, np.int64))
    return sum(int(action_rows(int(t), TRAIN_LENGTHS[int(e)], spec)[1].sum()) for e, t in zip(eps, ts))


def optimizer_state(run_dir: str) -> dict[str, torch.Tensor]:
    """{param/state: tensor} of the run's final checkpoint, through `ckpt reshard` to 1 rank (the
    universal per-parameter files, whatever layout wrote it)."""
    from loongforge.train.ckpt.files import ckpt_root, load_trusted
    from loongforge.train.ckpt.reshard import Layout, reshard

    tag = reshard(run_dir, Layout(world=1, zero=2), move_latest=False)
    zero = os.path.join(ckpt_root(run_dir), tag, "universal_tp00", "zero")
    return {f"{name}/{state}": load_trusted(os.path.join(zero, name, f"{state}.pt"))["param"].float()
            for name in sorted(os.listdir(zero)) if os.path.isdir(os.path.join(zero, name)) for state in STATES}


@pytest.fixture(scope="module")
def one_rank(train_root, tmp_path_factory):
    root, _ = train_root
    work = tmp_path_factory.mktemp("split_ref")
    run_dir = str(work / "run")
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, *COMMON],
                     cwd=str(work), timeout=400))
    return read_metrics(run_dir), optimizer_state(run_dir)


def _same_training(one_rank, run_dir: str, *, uneven: bool) -> None:
    want, want_state = one_rank
    got = read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(STEPS))
    if uneven:  # the ranks' valid-row counts differ at some step: the case a per-rank mean gets wrong
        assert any(len({valid_rows(ids) for ids in r["sample_ids"]}) > 1 for r in got)
    for a, b in zip(want, got, strict=True):
        assert sorted(sum(b["sample_ids"], [])) == sorted(sum(a["sample_ids"], []))  # the same global batch
        for key in ("loss", "flow_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
    state = optimizer_state(run_dir)
    assert state.keys() == want_state.keys()
    # Relative to the whole state's norm, per kind: a single tensor is no yardstick where the true gradient
    # is zero (an attention key bias: softmax ignores it), as Adam turns round-off there into lr-sized steps.
    for kind in STATES:
        keys = [k for k in want_state if k.endswith("/" + kind)]
        ref = torch.cat([want_state[k].flatten() for k in keys])
        diff = torch.cat([(state[k] - want_state[k]).flatten() for k in keys])
        assert float(diff.norm() / ref.norm()) <= 1e-5, (kind, float(diff.norm() / ref.norm()))


@pytest.mark.slow
def test_two_data_parallel_ranks_equal_one(one_rank, train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "dp2")
    assert_ok(torchrun(2, ["--data", root, "--run-dir", run_dir, *COMMON], cwd=str(tmp_path), timeout=400))
    _same_training(one_rank, run_dir, uneven=True)


@pytest.mark.slow
@pytest.mark.full  # grad accumulation's equivalence is also the elastic test's (2 ranks -> 1 rank x accum 2, losses equal)
def test_grad_accum_equals_one_micro_batch(one_rank, train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "accum2")
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, *COMMON,
                      "--grad-accum", "2"], cwd=str(tmp_path), timeout=400))
    _same_training(one_rank, run_dir, uneven=False)


@pytest.mark.slow
@pytest.mark.full  # 4 processes on 2 cores (~2 min); make test keeps DP 2 and grad-accum 2
def test_tp2_at_dp2_equals_one_rank(one_rank, train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "tp2dp2")
    assert_ok(torchrun(4, ["--data", root, "--run-dir", run_dir, *COMMON, "--tp", "2"], cwd=str(tmp_path),
                       timeout=600))
    _same_training(one_rank, run_dir, uneven=True)


@pytest.mark.slow
@pytest.mark.full  # make test keeps the ZeRO-2 DP 2 case; ZeRO-3 averages over DP in its reduce-scatter
@pytest.mark.parametrize("extra", [["--zero", "3"], ["--zero", "3", "--grad-compression", "topk",
                                                      "--compress-ratio", "1"]], ids=["zero3", "topk-dense"])
def test_zero3_and_compressed_sync_at_dp2_equal_one_rank(extra, one_rank, train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "dp2")
    assert_ok(torchrun(2, ["--data", root, "--run-dir", run_dir, *COMMON, *extra], cwd=str(tmp_path),
                       timeout=400))
    _same_training(one_rank, run_dir, uneven=True)


@pytest.mark.slow
@pytest.mark.full  # two launches and a conversion (~1.5 min)
def test_dp2_resumed_on_one_rank_continues_the_one_rank_run(one_rank, train_root, tmp_path):
    """DP 2 for 4 steps, `ckpt reshard` to 1 rank, resumed with --grad-accum 2 (the hint's) to step 8:
    every step equals the uninterrupted 1-rank run, the padded rows counted globally on both sides."""
    from loongforge.train.ckpt.reshard import Layout, reshard

    root, _ = train_root
    run_dir = str(tmp_path / "dp2")
    first = [*COMMON, "--steps", "4", "--save-every", "4"]  # the later --steps wins
    assert_ok(torchrun(2, ["--data", root, "--run-dir", run_dir, *first], cwd=str(tmp_path), timeout=400))
    reshard(run_dir, Layout(world=1, zero=2))
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run_dir, *COMMON,
                      "--grad-accum", "2", "--resume"], cwd=str(tmp_path), timeout=400))
    _same_training(one_rank, run_dir, uneven=True)
