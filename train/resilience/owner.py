"""Ranks die with whatever launched them, however it died.

* `die_with_parent()`: PR_SET_PDEATHSIG (Linux): the kernel sends SIGTERM to this process when its
  parent exits, SIGKILL and OOM included. The elastic supervisor sets it on torchrun; a rank sets it
  on itself when a launcher started it (torchrun's agent, deepspeed's launch.py, the supervisor's
  torchrun), never for a plain `loongforge train`, which must outlive the shell of a `nohup`.
* `LauncherWatch`: PDEATHSIG sees only the parent. A rank also watches the launchers above it (the
  `deepspeed` runner above launch.py, the elastic supervisor above torchrun) and SIGTERMs itself
  when one is gone, so the rank's own SIGTERM path (stop.py) closes its decode workers and
  shared-memory segments.
* `rank_pids(pid)`: the training ranks below a launcher (the supervisor forwards SIGINT/SIGTERM to
  them directly, so torchrun's agent is never signalled and exits quietly).
"""

from __future__ import annotations

import ctypes
import contextlib
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
# argv words of a launcher; loongforge.train.resilience.elastic.agent is the supervisor's torchrun (elastic/agent.py),
# loongforge.train.warm its fork server, the parent of the ranks it forks (elastic/forks.py)
LAUNCHERS = (b"torchrun", b"torch.distributed.run", b"deepspeed", b"loongforge",
             b"loongforge.train.resilience.elastic.agent", b"loongforge.train.warm")


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when the parent exits (Linux; False elsewhere). Also safe in a
    preexec_fn (async-signal-safe: one syscall)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def proc_state(pid: int) -> str | None:
    """The state letter of a process (R, S, T, Z...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def rank_pid(run_dir: str, rank: int) -> int | None:
    """The live training process with RANK=`rank` whose command line names `run_dir` (fault tools,
    benchmarks and tests that kill one rank). Launchers (torchrun's agent, deepspeed's runner and
    per-node launcher) carry the same arguments but set RANK only in their children; decode workers
    inherit RANK but not the arguments; a rank forked by the warm server shows its stand-in's."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        args = cmdline(int(pid))
        if run_dir.encode() not in args:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode():
            return int(pid)
    return None


def is_launcher(pid: int) -> bool:
    args = cmdline(pid)[:4]
    return any(os.path.basename(a) in LAUNCHERS or a in LAUNCHERS or a.endswith(b"deepspeed/launcher/launch.py")
               or a == b"deepspeed.launcher.launch" for a in args)


def launcher_chain(pid: int | None = None) -> list[tuple[int, int]]:
    """(pid, start ticks) of the launchers above `pid` (default: this process), nearest first: the
    parent if it is one, and every launcher above it up to the first process that is not."""
    chain, cur = [], os.getppid() if pid is None else (proc_stat(pid) or (1, 0))[0]
    while cur > 1 and is_launcher(cur):
        st = proc_stat(cur)
        if st is None:
            break
        chain.append((cur, st[1]))
        cur = st[0]
    return chain


class LauncherWatch:
    """A daemon thread: when a launcher above this rank is gone, SIGTERM this process once."""

    def __init__(self, chain: list[tuple[int, int]], period_s: float = 1.0):
        self.chain, self.period_s = chain, period_s
        self._stop = threading.Event()

    def start(self) -> "LauncherWatch":
        if self.chain:
            threading.Thread(target=self._run, name="loongforge-launcher-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for pid, start in self.chain:
                st = proc_stat(pid)
                if st is None or st[1] != start:  # gone, or its pid reused
                    log.warning("the launcher above this rank (pid %d, %s) is gone: stopping this rank", pid,
                                b" ".join(cmdline(pid)[:2]).decode(errors="replace") or "exited")
                    os.kill(os.getpid(), signal.SIGTERM)
                    return


def children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        st = proc_stat(int(entry))
        if st is not None and st[0] == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    todo, out = [pid], []
    while todo:
        kids = children(todo.pop())
        out.extend(kids)
        todo.extend(kids)
    return out


def rank_pids(launcher_pid: int) -> list[int]:
    """The training ranks below a launcher: descendants running loongforge.train (decode workers,
    spawned by a rank, run multiprocessing's spawn_main and are not ranks)."""
    out = []
    for pid in descendants(launcher_pid):
        args = cmdline(pid)
        if b"loongforge.train" in args or any(a.endswith(b"loongforge/train/launch.py") for a in args):
            out.append(pid)
    return out


def signal_all(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
