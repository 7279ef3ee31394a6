"""Equal cores for both loaders: pin a pass to N cores, and count the CPU it burns.

"Equal workers" is not equal work: LoongForge's loader runs a prefetch thread
in the main process beside its decode workers, and PyAV's threaded decoding
spreads one worker over several cores. So every P1 pass runs inside `pinned(n)`:
the main process and all its threads are restricted to the same n cores, and
worker processes inherit that mask when they start (fork or spawn), so both
loaders get exactly the same cores. `CpuMeter` then reads the CPU seconds the
whole process tree (plus named helper processes such as the cache daemon) used
over the timed part of the pass, which gives samples per CPU-second: the
per-busy-core figure, independent of how the scheduler spread the work.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no pinning, the CPU meter still works
        return list(range(os.cpu_count() or 1))


def cores_for(workers: int) -> int:
    """The core budget of a pass with `workers` loader workers: one per worker,
    one for the main process when it does the decoding itself (workers=0)."""
    return max(1, workers)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


@contextmanager
def pinned(n: int):
    """Restrict this process (every thread: torch's intra-op pool, any prefetch
    thread) to the first n usable cores; restore the old mask on exit. Workers
    started inside inherit the mask. Yields the cores used (None: no pinning)."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    old = os.sched_getaffinity(0)
    cores = set(sorted(old)[:max(1, n)])
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended between listing and pinning
            pass
    try:
        yield sorted(cores)
    finally:
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, old)
            except OSError:
                pass


class CpuMeter:
    """CPU seconds of this process, its live descendants and `extra_pids`
    between start() and stop(). Descendants are read while alive (a worker's
    time is lost once it exits unread), so stop() must run before the loader
    closes; a worker that starts after start() counts from its birth."""

    def __init__(self, extra_pids: tuple[int, ...] = ()):
        self.extra_pids = tuple(p for p in extra_pids if p)
        self._start: dict[int, float] = {}
        self.cpu_s = 0.0
        self.own_s = 0.0  # of cpu_s: this process alone (the rest is its descendants and extra_pids)

    def _snapshot(self) -> dict[int, float]:
        import psutil

        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        for pid in self.extra_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def start(self) -> None:
        self._start = self._snapshot()

    def stop(self) -> float:
        end = self._snapshot()
        self.cpu_s = sum(v - self._start.get(pid, 0.0) for pid, v in end.items())
        me = os.getpid()
        self.own_s = end.get(me, 0.0) - self._start.get(me, 0.0)
        return self.cpu_s
