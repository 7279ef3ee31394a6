"""The trackers inside real launches of the trainer: the default TensorBoard of a 2-rank run, a missing
package refused before any process group, and (`full`) a 2-rank run SIGKILLed and resumed with
TensorBoard and W&B, then `loongforge profile` adding to the same run."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from loongforge.train.observe.breakdown import breakdown
from loongforge.train.observe.metrics import read_metrics
from loongforge.train.observe.tracking import STATE_FILE, TB_DIR, step_scalars

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from readback import tensorboard_accumulator, tensorboard_scalars, wandb_history, wandb_summary  # noqa: E402

from tests.train.train_launch import VENV_BIN, _port, assert_ok, launch, launch_env, torchrun  # noqa: E402

pytestmark = pytest.mark.slow
COMMON = ["--batch-size", "8", "--recipe", "tiny", "--seed", "1", "--block-window", "8", "--lr", "3e-3",
          "--no-ds-breakdown"]


def _same_as_metrics(tb: dict, rows: dict) -> None:
    for tag, points in tb.items():
        if tag.startswith(("train/", "train_time/")):
            assert [s for s, _ in points] == sorted(rows), tag
            assert [v for _, v in points] == pytest.approx([step_scalars(rows[s])[tag] for s in sorted(rows)],
                                                           rel=1e-6), tag


def test_a_2_rank_run_reports_to_tensorboard_by_default(zero3_run):
    """The shared ZeRO-3 run (2 ranks, no --report-to): rank 0 wrote TensorBoard events, every step once, each
    scalar equal to metrics.jsonl, the grad norm among them; the resolved config as text."""
    rows = {r["step"]: r for r in read_metrics(zero3_run)}
    assert sorted(rows) == list(range(4)) and all(r["grad_norm"] > 0 for r in rows.values())
    tb = tensorboard_scalars(zero3_run)
    assert {"train/loss", "train/grad_norm", "train/lr", "train_time/data_wait_pct", "train_time/compute_ms"} <= set(tb)
    _same_as_metrics(tb, rows)
    acc = tensorboard_accumulator(zero3_run)
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"zero_stage": 3' in config
    (name,) = os.listdir(os.path.join(zero3_run, TB_DIR))  # the run, by its directory's name
    assert name == os.path.basename(zero3_run)
    (events,) = os.listdir(os.path.join(zero3_run, TB_DIR, name))  # rank 0's writer only
    assert events.startswith("events.out.tfevents.")
    assert not os.path.exists(os.path.join(zero3_run, "wandb"))


def test_report_to_wandb_without_the_package_is_one_line_before_any_process_group(train_root, tmp_path, monkeypatch,
                                                                                  capsys):
    """A rank's whole entry (launch.run_args), in this process, with wandb absent: exit 2, one line, and the
    process group never started (a spy in the trainer's init_distributed)."""
    from loongforge.train import flags, launch as entry, trainer

    root, _ = train_root
    reached = []
    monkeypatch.setattr(trainer, "init_distributed", lambda *a, **k: reached.append(a) or 1 / 0)
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib reports for a package that is absent
    old = signal.getsignal(signal.SIGTERM)
    p = argparse.ArgumentParser()
    flags.add_train_args(p)
    run_dir = tmp_path / "run"
    try:
        code = entry.run_args(p.parse_args(["--data", root, "--run-dir", str(run_dir), "--device", "cpu",
                                            "--report-to", "tensorboard,wandb"]))
    finally:
        signal.signal(signal.SIGTERM, old)  # run_args installs its SIGTERM handler
    err = capsys.readouterr().err
    assert code == 2 and reached == []
    assert err.strip().splitlines() == [
        "loongforge train: config error: --report-to tensorboard,wandb: the wandb package is not installed; "
        "pip install 'loongforge[track]' (or drop it from --report-to)"], err
    assert not run_dir.exists()  # nothing started: no metrics.jsonl, no lock, no tracker files


def _popen_torchrun(args: list[str], cwd: str, env: dict):
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_port()), "-m",
           "loongforge.train", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=launch_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _kill_all(pid: int) -> None:
    """SIGKILL the launcher and everything under it: ranks (each in a session of its own), decode workers,
    W&B's service process."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# `full`: two 2-rank launches (~60 CPU s). make test covers the same behaviour with a real Tracker in its own
# process, SIGKILLed and resumed: test_tracking.py::test_sigkill_then_resume_every_step_once_in_tensorboard_and_wandb,
# and the trainer's calls to it in a 2-rank launch: test_a_2_rank_run_reports_to_tensorboard_by_default.
@pytest.mark.full
def test_killed_2_rank_run_resumed_shows_every_step_once_then_profile_adds_to_it(train_root, tmp_path):
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    args = ["--data", root, "--run-dir", run_dir, "--steps", "12", "--save-every", "4", "--zero", "2",
            "--report-to", "tensorboard,wandb", "--wandb-project", "tests", "--wandb-run-name", "killed", *COMMON]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = _popen_torchrun(args, str(tmp_path), env)
    deadline = time.monotonic() + 400
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    latest = lambda: int(open(pointer).read().strip()[4:]) if os.path.exists(pointer) else None  # noqa: E731
    try:  # killed two steps past a checkpoint: the resume re-runs them
        while latest() is None or len(read_metrics(run_dir)) < latest() + 2:
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, "no checkpoint and two more steps"
            time.sleep(0.05)
    finally:
        _kill_all(proc.pid)
        proc.wait()
    restored = latest()
    before = {r["step"]: r for r in read_metrics(run_dir)}
    assert restored < 12 and max(before) > restored
    shutil.copy(os.path.join(run_dir, STATE_FILE), tmp_path / "state-before.json")
    assert_ok(torchrun(2, [*args, "--resume"], cwd=str(tmp_path), env=env, timeout=400))
    after = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(after) == list(range(12))
    assert (tmp_path / "state-before.json").read_text() == open(os.path.join(run_dir, STATE_FILE)).read()

    _same_as_metrics(tensorboard_scalars(run_dir), after)  # from step 4 on, the resumed launch's values
    hist = wandb_history(run_dir)
    assert [s for _, s, _ in hist] == list(range(12))
    for n, s, got in hist:  # launch 1's rows W&B kept (values as then), the rest from launch 2 or its backfill
        want = step_scalars(before[s] if n == 0 or s < restored else after[s])
        assert {k: got[k] for k in want} == want, s
    assert {n for n, _, _ in hist} <= {0, 1}

    out = launch([str(VENV_BIN / "loongforge"), "profile", run_dir], cwd=str(tmp_path), env=env, timeout=200)
    assert_ok(out)
    acc = tensorboard_accumulator(run_dir)
    chart = acc.Images("profile/chart")
    assert [e.step for e in chart] == [12] and chart[0].width > 500
    table = acc.Tensors("profile/breakdown/text_summary")[0].tensor_proto.string_val[0].decode()
    assert all(p in table for p in ("data wait", "communication", "launch/dispatch overhead", "compute"))
    summary = wandb_summary(run_dir)
    assert summary["profile/breakdown"]["_type"] == "table-file" and summary["profile/chart"]["_type"] == "image-file"
    assert summary["profile/step_ms"] == pytest.approx(1e3 * breakdown(run_dir)["step_s"])
