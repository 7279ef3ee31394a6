"""Fixtures every test area shares: a real redis-server, synthetic shard roots."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server process on a private port, stoppable and restartable
    (tests kill it mid-run to check degradation)."""

    def __init__(self, workdir: Path, password: str | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found: run `make test` (it installs it via apt-get)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def synthetic_root(tmp_path):
    """A small valid shard root (4 shards x 8 samples, 2 cameras)."""
    from loongforge.shared.synthetic import make_synthetic_root

    root = tmp_path / "shards"
    index = make_synthetic_root(str(root))
    return str(root), index
