"""Config errors fail before any process group, with exit code 2."""

import argparse
import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import launch  # noqa: E402

from loongforge.train.parallel import engine
from loongforge.train import flags, launch as entry  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(*argv):
    p = argparse.ArgumentParser()
    flags.add_train_args(p)
    return p.parse_args(list(argv))


@pytest.fixture
def no_process_group(monkeypatch):
    """A spy in place of init_distributed: a config error must be raised before it is reached."""
    calls = []

    def spy(*a, **k):
        calls.append(a)
        raise AssertionError("init_distributed reached with a bad config")

    monkeypatch.setattr(engine, "init_distributed", spy)
    old = signal.getsignal(signal.SIGTERM)
    yield calls
    signal.signal(signal.SIGTERM, old)  # run_args installs its SIGTERM handler


@pytest.mark.parametrize("bad, field", [
    (["--recipe", "huge"], "recipe"),
    (["--batch-size", "6"], "data.global_batch_size"),  # 6 does not divide by WORLD_SIZE=4
    (["--data", "/nonexistent/shards"], "data.root"),
    (["--zero", "3", "--compress-ratio", "3"], "--compress-ratio 3 needs --grad-compression topk"),  # not ignored
])
def test_config_error_before_init_distributed(bad, field, train_root, tmp_path, monkeypatch, no_process_group,
                                              capsys):
    root, _ = train_root
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    args = _args("--data", root, "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--batch-size", "8", *bad)
    assert entry.run_args(args) == 2
    assert no_process_group == []
    err = capsys.readouterr().err
    assert f"config error: {field}" in err and len(err.strip().splitlines()) == 1, err
    # The failed Trainer left no start-up watch armed: at --startup-timeout-s it would have ended this
    # process (a test run, a notebook) with exit 75, long after the error.
    for t in threading.enumerate():
        if t.name == "loongforge-startup-watch":
            t.join(timeout=5)
            assert not t.is_alive()


def test_a_format_1_root_is_a_config_error_naming_the_converter(train_root, tmp_path, monkeypatch,
                                                                no_process_group, capsys):
    """The retired format (tests/legacy_v1.py writes one): refused in preflight, one line, with the fix."""
    from tests.legacy_v1 import v1_copy_of

    root, _ = train_root
    v1 = str(tmp_path / "v1")
    v1_copy_of(root, v1, frames_per_sample=2, stride=2, action_horizon=4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert entry.run_args(_args("--data", v1, "--run-dir", str(tmp_path / "run"), "--check-config")) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "config error: data.root" in x)
    assert "format_version 1" in line and "`loongforge convert ROOT --to v2 OUT`" in line
    assert no_process_group == []


def test_check_config_ok_and_bad(train_root, tmp_path, monkeypatch, no_process_group, capsys):
    root, _ = train_root
    monkeypatch.setenv("WORLD_SIZE", "2")
    ok = _args("--data", root, "--run-dir", str(tmp_path), "--batch-size", "8", "--check-config")
    assert entry.run_args(ok) == 0 and "config ok" in capsys.readouterr().out
    bad = _args("--data", root, "--run-dir", str(tmp_path), "--batch-size", "6", "--grad-accum", "2",
                "--check-config")
    assert entry.run_args(bad) == 2 and "pick a multiple of 4" in capsys.readouterr().err
    assert no_process_group == []


@pytest.mark.parametrize("script, pre", [("launch_torchrun.sh", []), ("launch_deepspeed.sh", ["--gpus", "2", "--"])])
def test_launch_scripts_exit_2_on_config_error_before_any_rank(script, pre, train_root, tmp_path):
    """torchrun returns 1 for any failed rank; the script's preflight in the launcher process returns 2."""
    root, _ = train_root
    t0 = time.monotonic()
    proc = launch(["bash", os.path.join(REPO, "infra", "train", script), *pre, "--data", root, "--run-dir",
                   str(tmp_path / "run"), "--recipe", "huge"], cwd=str(tmp_path), timeout=120, warm=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: recipe" in proc.stderr
    assert "torch.distributed" not in proc.stderr and "rendezvous" not in proc.stderr.lower()
    assert time.monotonic() - t0 < 60


def test_help_renders():
    """argparse %-formats help strings: a bare '%' in one made `--help` raise ValueError."""
    p = argparse.ArgumentParser()
    flags.add_train_args(p)
    assert "--video-deltas" in p.format_help()
