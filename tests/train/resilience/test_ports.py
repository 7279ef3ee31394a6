"""A launch that picks its own port picks a free one: with another job listening on 29500 (torchrun's and
DeepSpeed's default), the one-node launch scripts still train. (`make demo` launches through the elastic
supervisor, which takes a free port for every attempt; before, it used the deepspeed launcher's 29500 and
died with a 30-line EADDRINUSE traceback when anything else held it.)"""

import contextlib
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON  # noqa: E402
from tests.train.train_launch import launch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _port_taken(port: int = 29500):
    """Another job on `port` (if something already holds it, that does as well)."""
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        s.listen()
    except OSError:
        pass
    try:
        yield
    finally:
        s.close()


def _train_with_29500_taken(script: str, pre: list[str], train_root, tmp_path, env=None, extra=()):
    root, _ = train_root
    run_dir = tmp_path / "run"
    with _port_taken():
        proc = launch(["bash", os.path.join(REPO, "infra", "train", script), *pre, "--data", root, "--run-dir",
                       str(run_dir), "--steps", "1", *COMMON, *extra], cwd=str(tmp_path), timeout=300,
                      env={**os.environ, "NPROC": "1", **(env or {})}, warm=False)  # the scripts' own launch
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000001"
    assert "EADDRINUSE" not in proc.stderr and "address already in use" not in proc.stderr.lower()
    return proc


def test_the_torchrun_script_trains_while_another_job_holds_29500(train_root, tmp_path):
    """Also with MASTER_PORT=29500 left in the environment (a one-node launch does not need it). The run dir
    holds a finished run and the launch says --overwrite: rank 0 moves it aside, under the run lock, before
    its process group (test_rundir.py has the refusals without it)."""
    from tests.train.resilience.test_rundir import _old_run, _snapshot

    before = _old_run(tmp_path / "run")
    proc = _train_with_29500_taken("launch_torchrun.sh", [], train_root, tmp_path, env={"MASTER_PORT": "29500"},
                                   extra=["--overwrite"])
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert _snapshot(aside) == before and f"moved aside to {aside}" in proc.stderr


# The torchrun script above covers a one-node launch that picks its port; this is the deepspeed launcher's.
@pytest.mark.full
def test_the_deepspeed_script_trains_while_another_job_holds_29500(train_root, tmp_path):
    _train_with_29500_taken("launch_deepspeed.sh", ["--gpus", "1", "--"], train_root, tmp_path)
