"""One live run per run directory: an advisory lock on RUN_DIR/run.lock for the run's lifetime.

Who holds it: the elastic supervisor (for all its launches; across nodes, the leader: nodes.py),
else rank 0 of a launch (before its process group; the other ranks then fail with the launch when
rank 0 exits 2). A second launch on
a locked run dir exits 2 naming the holder (host, pid, start time, command): two runs writing one
`latest` would mix their checkpoints. The supervisor's ranks see its pid in LOCK_OWNER_ENV and do
not lock again.

The lock is flock(2) on an fd kept open by the holder, so the kernel releases it whenever the holder
dies, SIGKILL and OOM included; the file stays (it records the last holder) and is not a lock by
itself. Where it holds: local filesystems (ext4, xfs, btrfs, tmpfs, overlayfs); NFSv3 (with lockd)
and NFSv4, where Linux implements flock() with byte-range locks seen by every client; CephFS; GPFS;
Lustre only when mounted with `-o flock` (`localflock` makes it node-local). Not across nodes on
FUSE object-store mounts (s3fs, gcsfuse) or Lustre without `flock`: there it only stops a second
launch on the same node. An NFSv4 lease may keep a crashed client's lock for ~90 s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from datetime import datetime, timezone

from loongforge.shared.errors import UsageError

LOCK_FILE = "run.lock"
LOCK_OWNER_ENV = "LOONGFORGE_RUN_LOCK_OWNER"  # "PID@HOST" of the process that holds the lock for this launch


class RunLock:
    def __init__(self, run_dir: str, extra: dict | None = None):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK_FILE)
        self.extra = extra or {}  # more about the holder, in the lock file (the elastic leader: its nodes)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        """Take the lock or raise UsageError naming its holder (exit 2)."""
        if not self.try_acquire():
            raise UsageError(f"--run-dir {self.run_dir} is in use by a live run ({describe(holder(self.run_dir))}); "
                             "stop that run first, or give another --run-dir")
        return self

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it (True), else False."""
        if self._fd is not None:
            return True
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return False
        doc = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
               "command": shlex.join(sys.argv), **self.extra}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(doc) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the last fd drops the flock
            self._fd = None


def is_held(run_dir: str) -> bool:
    """Someone holds the run dir's lock now (tested without creating the lock file)."""
    return lock_file_held(os.path.join(run_dir, LOCK_FILE))


def lock_file_held(path: str) -> bool:
    """Someone holds an flock on `path` now (False when the file does not exist; never creates it)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


def joins_live_run(run_dir: str, nodes: int) -> bool:
    """An elastic supervisor of a `nodes`-node run finds a live multi-node leader to follow (nodes.py)."""
    return nodes > 1 and is_held(run_dir) and int(holder(run_dir).get("nodes", 1)) > 1


def holder(run_dir: str) -> dict:
    """The last holder recorded in the lock file (the live one while it is locked)."""
    try:
        with open(os.path.join(run_dir, LOCK_FILE)) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def describe(doc: dict) -> str:
    if not doc:
        return "holder unknown"
    started = datetime.fromtimestamp(doc.get("started", 0), timezone.utc).isoformat(timespec="seconds")
    return f"pid {doc.get('pid')} on {doc.get('host')}, started {started}: {doc.get('command', '?')}"


def acquire_for_rank(run_dir: str, rank: int) -> RunLock | None:
    """Rank 0 locks the run dir unless the supervisor that started it (or, across nodes, the leader its
    supervisor follows: LOCK_OWNER_ENV = "PID@HOST") holds the lock already."""
    if rank != 0:
        return None
    owner = os.environ.get(LOCK_OWNER_ENV)
    if owner:
        pid, _, host = owner.partition("@")
        doc = holder(run_dir)
        same = str(doc.get("pid")) == pid and (not host or doc.get("host") == host)
        local = not host or host == socket.gethostname()  # a pid on another host cannot be probed from here
        if same and (not local or _pid_alive(int(pid))):
            return None
    return RunLock(run_dir).acquire()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
