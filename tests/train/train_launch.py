"""Run real launches (torchrun, the deepspeed launcher, plain python) as
subprocesses with a timeout; a hang becomes a test failure with the log tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
# The session's fork server (conftest.warm_ranks): a rank launched through launch() or torchrun() is forked
# from it, its imports done (resilience/elastic/forks.py; ~3x a bare `import torch` per rank, the largest part
# of a short test launch). The rank runs the same code as a fresh `python -m loongforge.train`; tests of the
# launch itself (launchers, signals, process ownership, start-up) pass warm=False or build their environment
# with launch_env(), which is plain, as the deepspeed launcher's runs are. Started at the first warm launch,
# which waits for it anyway: its imports never compete with a test computing in this process.
WARM: dict = {"log": None, "server": None}  # conftest sets "log" (None: off); the server once started


def warm_socket() -> str | None:
    from loongforge.train.resilience.elastic import forks

    if WARM["log"] is None:
        return None
    if WARM["server"] is None:
        WARM["server"] = forks.Server.start(env=launch_env(), log_path=WARM["log"]) or False
    return WARM["server"].path if WARM["server"] else None


def launch_env(env: dict | None = None, *, cuda: bool = False, warm: bool = False) -> dict:
    """The environment of every launch: one OpenMP thread per rank (2 cores shared by all ranks),
    unbuffered logs, the venv's torchrun/deepspeed first on PATH. A CPU launch hides the GPUs, so
    on a GPU machine it stays a CPU run: the trainer's `--device auto` and DeepSpeed's own probe
    both see no CUDA (nothing forces DS_ACCELERATOR, which would split them). `cuda=True` for the
    GPU tests. `warm`: ranks forked from the session's fork server (WARM), CPU launches only."""
    from loongforge.train.resilience.elastic.forks import WARM_ENV

    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DS_ACCELERATOR", None)
    env.pop(WARM_ENV, None)
    if warm and not cuda and (path := warm_socket()) is not None:
        env[WARM_ENV] = path
    if cuda:
        if env.get("CUDA_VISIBLE_DEVICES") == "":
            env.pop("CUDA_VISIBLE_DEVICES")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


def torchrun_cmd(nproc: int, target: list[str]) -> list[str]:
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(_port()), *target]


def deepspeed_cmd(nproc: int, target: list[str]) -> list[str]:
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(_port()), *target]


def assert_ok(proc) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-6000:]}"


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(cmd: list[str], *, cwd: str, timeout: float = 240, env: dict | None = None,
           cuda: bool = False, warm: bool = True) -> subprocess.CompletedProcess:
    env = launch_env(env, cuda=cuda, warm=warm)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"launch timed out after {timeout}s: {' '.join(cmd)}\n{(exc.stderr or '')[-3000:]}")
    return proc


def torchrun(nproc: int, args: list[str], *, cwd: str, timeout: float = 240, env: dict | None = None,
             cuda: bool = False, warm: bool = True):
    return launch(torchrun_cmd(nproc, ["-m", "loongforge.train", *args]), cwd=cwd, timeout=timeout, env=env,
                  cuda=cuda, warm=warm)


def deepspeed_launch(nproc: int, args: list[str], *, cwd: str, timeout: float = 240, module: bool = False):
    """The deepspeed launcher, with the script path (what infra/demo.sh does) or --module. Its
    launcher sets CUDA_VISIBLE_DEVICES per rank itself (to "0,1" even on its CPU accelerator), so
    a CPU launch also names the device."""
    import loongforge.train.launch as entry

    target = ["--module", "loongforge.train"] if module else [entry.__file__]
    device = [] if "--device" in args else ["--device", "cpu"]
    return launch(deepspeed_cmd(nproc, [*target, *args, *device]), cwd=cwd, timeout=timeout, warm=False)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_script(nproc: int, script: str, args: list[str], *, cwd: str, timeout: float = 240):
    """torchrun of a test worker script (a file path), for checks below the trainer's entry point."""
    return launch(torchrun_cmd(nproc, [script, *args]), cwd=cwd, timeout=timeout)
