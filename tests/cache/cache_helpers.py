"""Cache test helpers: every daemon is a real `python -m loongforge.cache serve` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loongforge.cache.client import CacheClient
from loongforge.cache.protocol import Connection
from loongforge.shared.index import ShardIndex

READY = "cache daemon ready on"
PEER_SECRET = "loongforge-test-peer-secret-0123456789abcdef"  # the test deployment's; >= 32 bytes


class DaemonProc:
    """One cache daemon = one node. Tiers live under tmp_path (RAM dir too: on
    a test box /dev/shm and tmp behave the same for correctness)."""

    def __init__(self, tmp: Path, root: str, index: ShardIndex, name: str = "node-a", *, ram: str = "1MiB",
                 ssd: str = "4MiB", redis_url: str | None = None, extra: tuple[str, ...] = (), env: dict | None = None,
                 umask: int = -1, user=None):
        self.root, self.index, self.name = root, index, name
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        if user is not None:  # a users.User: the daemon runs as that uid, in a directory of its own
            os.chown(self.dir, user.uid, user.gid)
            os.chmod(self.dir, 0o750)
        self.socket = str(self.dir / "c.sock")
        self.ram_dir = str(self.dir / "ram")
        self.ssd_dir = str(self.dir / "ssd")
        self.log_path = self.dir / "daemon.log"
        self.args = [sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--socket", self.socket,
                     "--ram-dir", self.ram_dir, "--ram-budget", ram, "--ssd-dir", self.ssd_dir, "--ssd-budget", ssd,
                     "--node-id", name, "--prefetch-window", "0", "--heartbeat-s", "0.2", "--node-ttl-s", "2",
                     *(("--redis-url", redis_url, "--peer-listen", "127.0.0.1:0") if redis_url else ()), *extra]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOONGFORGE_LOG_LEVEL": "DEBUG",
                    **({"LOONGFORGE_CACHE_PEER_SECRET": PEER_SECRET} if redis_url else {}), **(env or {})}
        self.tcp = extra[extra.index("--tcp") + 1] if "--tcp" in extra else None
        if self.tcp:  # --socket and --tcp are exclusive
            self.args = [a for a in self.args if a not in ("--socket", self.socket)]
        if user is not None:
            self.args = user.argv(*self.args[3:])  # `serve ...` through tests/cache/run_as.py
        self.umask = umask  # the daemon's umask (-1: inherit the test's)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "DaemonProc":
        log = open(self.log_path, "a")
        offset = log.tell()  # a restarted daemon appends: only a READY line of this run counts
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, umask=self.umask)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY in self.log_path.read_text()[offset:] and ("--tcp" in self.args or os.path.exists(self.socket)):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"daemon {self.name} did not get ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self.proc = None
        return rc

    def request(self, op: str, **fields) -> dict:
        conn = Connection(None if self.tcp else self.socket, self.tcp, 10.0)
        try:
            return conn.request(op, **fields)
        finally:
            conn.close()

    def stats(self) -> dict:
        return self.request("stats")["stats"]

    def client(self, **kw) -> CacheClient:
        return CacheClient(self.root, self.index, socket_path=self.socket, **kw)


def counter(stats: dict, name: str, label: str) -> int:
    return stats["counters"][name].get(label, 0)


def settled(daemon) -> dict:
    """Stats once the SSD write-through queue is empty (it runs off the reader's path)."""
    return wait_for(lambda: (st := daemon.stats())["ssd_pending"] == 0 and st, what="ssd write-through")


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
