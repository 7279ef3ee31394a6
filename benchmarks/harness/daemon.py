"""Run a real `loongforge cache serve` process for the benchmark's lifetime.

The daemon is started exactly as an operator would start it, and the bench
waits for its "cache daemon ready on unix:<socket>" line (with a timeout:
a daemon that never gets ready fails the row, it never hangs the run).
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from loongforge.shared.errors import CacheUnavailableError

READY_MARK = "cache daemon ready on"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class CacheDaemon:
    """`with CacheDaemon(origin, workdir) as d: d.socket` — a fresh, empty cache."""

    def __init__(self, origin: str, workdir: Path, *, ram_budget: str = "2GiB", extra_args: tuple[str, ...] = ()):
        self.origin = origin
        self.workdir = Path(workdir)
        self.ram_budget = ram_budget
        self.extra_args = extra_args
        # AF_UNIX paths are limited to ~107 bytes; keep the socket name short.
        self.socket = str(self.workdir / "c.sock")
        # The RAM tier belongs on tmpfs: on a disk directory it would be a disk tier.
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        self.ram_dir = base / f"loongforge-bench-{os.getpid()}-{id(self):x}"
        self.ssd_dir = self.workdir / "ssd"
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "loongforge", "cache", "serve", "--origin", self.origin,
                "--socket", self.socket, "--ram-dir", str(self.ram_dir), "--ram-budget", self.ram_budget,
                # A private SSD tier: the default (~/.cache) would survive runs and make "cold" warm.
                "--ssd-dir", str(self.ssd_dir), *self.extra_args]

    def start(self) -> "CacheDaemon":
        # An empty RAM tier every time: "hot" must be earned by a warm-up pass.
        for d in (self.ram_dir, self.ssd_dir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if READY_MARK in line:
                return self
        self.stop()
        raise CacheUnavailableError("`loongforge cache serve` did not get ready within "
                                    f"{START_TIMEOUT_S:.0f}s; its output:\n" + "\n".join(self.log[-10:]))

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.log.append(line)
            del self.log[:-200]  # keep the tail only: the daemon may log per request
            self._lines.put(line)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.proc = None
        for d in (self.ram_dir, self.ssd_dir):
            shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> "CacheDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
