"""A real dask.distributed cluster for tests: `dask scheduler` and N single-threaded `dask worker`
processes on 127.0.0.1, as a user starts them (the project comes from this venv, as it would from an
install on each machine). Workers run without a nanny, so a SIGKILLed worker stays dead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 60


class DaskProcs:
    def __init__(self, workdir: Path, workers: int = 2, env: dict | None = None):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        # cwd is the work dir, not the checkout: the processes import loongforge from the venv's install
        self.env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "warning", **(env or {})}
        self.scheduler_file = workdir / "scheduler.json"
        # idle/death timeouts: nothing outlives a test process that died without its teardown
        self.scheduler = self._spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", "0",
                                                   "--no-dashboard", "--idle-timeout", "600",
                                                   "--scheduler-file", str(self.scheduler_file)])
        self.address = self._wait_address()
        self.workers = [self._spawn(f"w{i}", ["worker", self.address, "--nthreads", "1", "--no-nanny",
                                              "--no-dashboard", "--name", f"w{i}", "--death-timeout", "60",
                                              "--local-directory", str(workdir / f"w{i}")])
                        for i in range(workers)]
        if workers:
            self.wait_for_workers(workers)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        return subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=self.workdir, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT)

    def _wait_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler exited: {self.log('scheduler')}")
            try:
                return json.loads(self.scheduler_file.read_text())["address"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                time.sleep(0.1)
        raise RuntimeError(f"dask scheduler did not start in {START_TIMEOUT_S} s: {self.log('scheduler')}")

    def wait_for_workers(self, n: int) -> None:
        from distributed import Client

        with Client(self.address, timeout=START_TIMEOUT_S, set_as_default=False) as client:
            client.wait_for_workers(n, timeout=START_TIMEOUT_S)

    def worker_addresses(self) -> dict[str, str]:
        """worker name (w0, w1, ...) -> address."""
        from distributed import Client

        with Client(self.address, timeout=START_TIMEOUT_S, set_as_default=False) as client:
            return {w["name"]: addr for addr, w in client.scheduler_info(n_workers=-1)["workers"].items()}

    def kill_worker(self, i: int) -> None:
        self.workers[i].send_signal(signal.SIGKILL)
        self.workers[i].wait(timeout=10)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        """Workers first (they say goodbye to a live scheduler and exit at once), then the scheduler."""
        for group in (self.workers, [self.scheduler]):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
