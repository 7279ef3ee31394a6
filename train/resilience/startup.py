"""Start-up is bounded: stale build locks are removed, and a launch that does not finish its
first step in time ends with a message naming the phase it was stuck in.

Build locks. DeepSpeed builds (or, once built, loads) its CPU shared-memory allreduce op in every
rank's process-group set-up, through torch's extension lock: `<TORCH_EXTENSIONS_DIR>/
deepspeed_shm_comm/lock`, created with O_EXCL and held open by the builder for ~0.1-0.5 s (a
first build: the compile). A process killed while holding it leaves the file behind, and every
later launch waits on it forever (torch's FileBaton polls with no timeout), before any of this
project's code logs anything. `clear_stale_build_locks` runs before the process group: a lock
file that no live process on this host holds open (its owner died: the kernel closed the fd) is
stale and removed with a WARNING. On a network filesystem another host may be the owner, which
/proc cannot show, so there a lock is removed only once older than `stale_s`.

Start-up watchdog. `StartupWatch` is a thread started first thing in a rank; the trainer names
each phase (preflight, rendezvous, model and engine, loader, resume, first step). If the first
step has not finished within --startup-timeout-s, it logs one ERROR naming the phase, writes a
fault record (no rank to blame: the elastic supervisor relaunches the same ranks) and leaves with
EXIT_PEER_FAULT. The heartbeat watchdog (watchdog.py) takes over from the first step.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import threading
import time

from loongforge.train.resilience.exits import EXIT_PEER_FAULT, bounded, debug_log, exit_now, node_id, supervised

log = logging.getLogger(__name__)
NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "gpfs", "beegfs", "glusterfs", "9p",
              "afs", "fuse")  # fuse.*: sshfs, s3fs, gcsfuse...


def extensions_root() -> str:
    """Where torch builds JIT extensions (TORCH_EXTENSIONS_DIR, else its default root)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "torch_extensions")


def clear_stale_build_locks(root: str | None = None, *, stale_s: float = 300.0) -> list[str]:
    """Remove the extension build locks under `root` whose owner is gone; returns the removed paths."""
    root = root or extensions_root()
    locks = glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))
    removed = []
    for path in locks:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        age = time.time() - st.st_mtime
        holders = _local_holders(path)
        if holders:
            log.info("build lock %s is held by pid %s (a build or load in progress): waiting for it", path,
                     ", ".join(map(str, holders)))
            continue
        network = _fs_type(path).split(".")[0] in NETWORK_FS
        if network and age < stale_s:
            log.info("build lock %s (%.0f s old) is on a network filesystem: another host may hold it; removed "
                     "once older than %.0f s", path, age, stale_s)
            continue
        if _same_file(path, st):  # not replaced by a fresh lock since we looked
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
                log.warning("removed a stale build lock %s (%.0f s old, no live process holds it: its builder was "
                            "killed); without this the launch would wait on it forever", path, age)
    return removed


def _local_holders(path: str) -> list[int]:
    """Pids on this host with `path` open (torch's FileBaton keeps its O_EXCL fd open while it holds it)."""
    real, out = os.path.realpath(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(fd_dir, fd)) == real:
                    out.append(int(pid))
                    break
    return out


def _fs_type(path: str) -> str:
    """The filesystem type of the longest mount point above `path` (/proc/mounts)."""
    real, best, kind = os.path.realpath(path), "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    return kind


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def process_start_time(pid: int | str = "self") -> float | None:
    """When a process started (exec or fork), on the wall clock; None where /proc cannot say. The
    kernel counts it in clock ticks since boot (/proc/PID/stat field 22), converted here through
    CLOCK_BOOTTIME rather than /proc/stat's btime, which is rounded to the second."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupWatch:
    """Ends a rank whose first step has not finished within timeout_s (0 = off), naming the phase."""

    def __init__(self, timeout_s: float, *, run_dir: str, rank: int | None = None):
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.phase, self.detail = "start", ""
        self.closers: list = []
        self._done = threading.Event()
        self._t0 = time.monotonic()
        self.marks: list[tuple[str, float]] = [("setup", time.time())]  # (phase entered, wall clock): split()

    def start(self) -> "StartupWatch":
        if self.timeout_s > 0:
            threading.Thread(target=self._run, name="loongforge-startup-watch", daemon=True).start()
        return self

    def enter(self, phase: str, detail: str = "") -> None:
        self.phase, self.detail = phase, detail
        self.marks.append((phase, time.time()))

    def split(self, end: float) -> dict:
        """Where this process's start-up went, for the first step's record (`loongforge bench startup`):
        wall-clock seconds per phase from the process's start (its exec or fork) to `end`, the first
        step's end; `imports` is everything before the trainer (interpreter, imports, parsing). A phase
        entered twice (parallelize, around build_model) is summed."""
        start = process_start_time()
        phases = {"imports": round(self.marks[0][1] - start, 3)} if start is not None else {}
        for (name, t), (_, nxt) in zip(self.marks, [*self.marks[1:], ("end", end)]):
            phases[name] = round(phases.get(name, 0.0) + nxt - t, 3)
        return {"process_start": start, "first_step_end": end, "phases_s": phases}

    def done(self) -> None:
        self._done.set()

    def _run(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        took = time.monotonic() - self._t0
        why = f"no first step within {self.timeout_s:.0f} s (--startup-timeout-s): stuck in phase {self.phase!r}" + \
            (f" ({self.detail})" if self.detail else "")
        line = f"start-up: rank {self.rank}: {why}; ending this rank (exit {EXIT_PEER_FAULT})"
        if supervised():
            debug_log(self.run_dir, line)  # the supervisor prints the fault's one line
        else:
            log.error("%s", line)
        rec = {"v": 1, "event": "fault", "kind": "startup", "rank": None, "host": socket.gethostname(),
               "node": node_id(), "why": why, "phase": self.phase, "detected_by": self.rank,
               "detected_after_s": round(took, 2), "t": time.time()}
        if self.rank == 0:
            with contextlib.suppress(OSError):
                os.makedirs(self.run_dir, exist_ok=True)
                with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
        bounded(self.closers, 5.0, log)
        exit_now(EXIT_PEER_FAULT)
