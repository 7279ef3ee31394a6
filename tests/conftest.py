"""Fixtures every test area shares: a real redis-server, synthetic shard roots."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def pytest_configure(config):
    from tests.cpu_times import register

    register(config)  # opt-in per-test CPU seconds: LOONGFORGE_CPU_TIMES=out.json


@pytest.fixture(autouse=True)
def _keeps_torch_threads():
    """A test that runs a rank's code in-process (launch.main pins the intra-op threads and their
    environment variables) or sets torch's threads itself leaves the next test in this process the
    pool it found: under `make test`'s two workers the order of tests in a process is not fixed."""
    import sys

    from loongforge.train.resilience.threads import THREAD_VARS

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    env = {k: os.environ.get(k) for k in THREAD_VARS}
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def once_per_session(tmp_path_factory, name: str, make) -> Path:
    """`make(directory)` once for the whole session, its directory shared by every process of it.

    Under `make test` (pytest-xdist, one process per worker) a session fixture runs once per worker;
    the expensive ones (a trained run several files read) are made by the first worker that asks, under
    a file lock, and the others wait for it and read the same directory. Without xdist it is a plain
    temporary directory. A `make` that raises leaves no mark: the next asker tries again (and fails
    the same way, in its own test)."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        d = tmp_path_factory.mktemp(name)
        make(d)
        return d
    d = tmp_path_factory.getbasetemp().parent / f"shared-{name}"  # the session's directory, above the workers'
    done = d / ".made"
    with FileLock(str(d) + ".lock"):
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            make(d)
            done.write_text("ok\n")
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    """A server subprocess on a private port: wait until it listens, kill it."""

    port: int
    proc: subprocess.Popen | None = None

    def _wait_listening(self, timeout: float, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text()[-2000:] if log else ""
                raise RuntimeError(f"{what} exited with code {self.proc.returncode} before listening\n{tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{what} did not listen on port {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class RedisServer(_ServerProcess):
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
        self._wait_listening(10, "redis-server")
        return self


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 128 KiB filesystem (tmpfs), so writes hit a real ENOSPC. Needs root (CI is)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {out.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


SYNTHETIC_LENGTHS = (62, 62, 62, 62)  # one episode a shard: 4 shards of 42 KiB (tests/cache budgets; not whole pages)


@pytest.fixture
def synthetic_root(tmp_path):
    """A small valid shard root: 4 episodes of 62 frames, one per shard (42 KiB each), 2 cameras.
    Returns (root, its shard-level ShardIndex)."""
    from loongforge.shared.dataset import load_shard_index
    from loongforge.shared.synthetic import make_synthetic_root

    root = tmp_path / "shards"
    make_synthetic_root(str(root), lengths=SYNTHETIC_LENGTHS, shard_size=1)
    return str(root), load_shard_index(str(root))


class S3Server(_ServerProcess):
    """A real S3-compatible HTTP endpoint (moto's server) on a private port.
    Code under test reaches it as it would reach AWS: through s3fs/botocore,
    configured only by the standard AWS_* environment variables, which child
    processes (cache daemons, Beam workers) inherit."""

    ENV = {"AWS_ACCESS_KEY_ID": "loongforge-test", "AWS_SECRET_ACCESS_KEY": "loongforge-test",
           "AWS_DEFAULT_REGION": "us-east-1"}

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "moto.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "S3Server":
        import sys

        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        self._wait_listening(30, "moto server", self.log)
        return self

    def bucket(self, name: str) -> str:
        import fsspec

        fs = fsspec.filesystem("s3")
        fs.mkdir(name)
        return f"s3://{name}"

    def upload(self, local_dir: str, url: str) -> str:
        """Copy a local tree to `url` (s3://bucket/prefix), file by file."""
        import fsspec

        fs = fsspec.filesystem("s3")
        for d, _, files in os.walk(local_dir):
            for f in files:
                src = os.path.join(d, f)
                fs.put_file(src, url + "/" + os.path.relpath(src, local_dir))
        return url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One S3 endpoint per session (s3fs caches filesystem objects per process,
    so the endpoint must not move between tests); give each test its own bucket."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    saved = {k: os.environ.get(k) for k in (*S3Server.ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3Server.ENV, AWS_ENDPOINT_URL=server.endpoint)
    server.start()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
