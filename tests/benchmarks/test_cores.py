"""Equal cores: a pinned pass restricts every thread and every worker it starts
to the same cores, and the CPU meter counts what the process tree burned."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from loongforge.benchmarks.harness.cores import CpuMeter, cores_for, pinned, usable_cores

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


def _report_affinity(q):
    q.put(sorted(os.sched_getaffinity(0)))


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _tid_affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@needs_affinity
def test_pinned_covers_existing_threads_and_new_workers_then_restores():
    before = os.sched_getaffinity(0)
    ready, stop = threading.Event(), threading.Event()
    tids = []

    def idle():
        tids.append(threading.get_native_id())
        ready.set()
        stop.wait(10)

    t = threading.Thread(target=idle)
    t.start()  # a thread that exists before pinning, like torch's intra-op pool or the prefetch thread
    ready.wait(5)
    try:
        with pinned(1) as cores:
            assert cores == [usable_cores()[0]]
            assert os.sched_getaffinity(0) == set(cores)
            assert _tid_affinity(tids[0]) == set(cores)
            for method in ("fork", "spawn"):  # DataLoader forks, LoongForge's workers may spawn
                q = mp.get_context(method).Queue()
                p = mp.get_context(method).Process(target=_report_affinity, args=(q,))
                p.start()
                assert q.get(timeout=60) == cores
                p.join(30)
        assert os.sched_getaffinity(0) == before and _tid_affinity(tids[0]) == before
    finally:
        stop.set()
        t.join()


def test_cores_for_gives_the_main_process_a_core_when_it_decodes_itself():
    assert [cores_for(w) for w in (0, 1, 2, 4)] == [1, 1, 2, 4]


def test_cpu_meter_counts_a_busy_child_and_not_an_idle_wait():
    meter = CpuMeter()
    meter.start()
    time.sleep(0.3)  # waiting burns no CPU
    idle = meter.stop()
    assert idle < 0.2
    ctx = mp.get_context("fork")
    meter.start()
    p = ctx.Process(target=_spin, args=(0.5,))
    p.start()
    _spin(0.3)
    time.sleep(0.05)
    busy_seen = None
    while p.is_alive() and busy_seen is None:
        time.sleep(0.05)
        import psutil

        try:
            t = psutil.Process(p.pid).cpu_times()
            if t.user + t.system >= 0.45:
                busy_seen = meter.stop()
        except psutil.NoSuchProcess:
            break
    p.join(30)
    if busy_seen is None:
        pytest.skip("the child finished before it could be read (machine too loaded)")
    assert busy_seen >= 0.3 + 0.45 - 0.05  # the parent's spin and the child's, both counted
