"""Opt-in per-test CPU accounting: `LOONGFORGE_CPU_TIMES=out.json pytest ...` records,
for each test phase, the user+sys seconds of the pytest process plus those of its
children, reaped (getrusage RUSAGE_SELF / RUSAGE_CHILDREN deltas) or still alive
(/proc), and wall time.

NOTE: CPU seconds, not wall time, because the dev box is shared by several busy
processes: wall time measures the neighbours, CPU seconds measure the test. Lost:
a grandchild orphaned to init (init reaps it, not us).
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


_TICK = os.sysconf("SC_CLK_TCK")


def _live_descendants_cpu(pid: int) -> float:
    """CPU seconds of the live descendants (own + what they reaped). Reaping moves a child's total into
    our RUSAGE_CHILDREN, so own + reaped + live is conserved across phases: a process pool or a server
    that outlives one test is charged to the tests during which it burned CPU."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            for kid in kids:
                try:
                    with open(f"/proc/{kid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                total += sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
                todo.append(kid)
    return total


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + _live_descendants_cpu(os.getpid())


class CpuTimes:
    def __init__(self, path: str):
        self.path = path
        self.rows: dict[str, dict[str, float]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._measure(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._measure(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._measure(item, "teardown")

    def _measure(self, item, phase: str):
        own0, kids0 = _cpu()
        t0 = time.monotonic()
        yield
        own1, kids1 = _cpu()
        row = self.rows.setdefault(item.nodeid, {})
        row[f"{phase}_self"] = round(own1 - own0, 3)
        row[f"{phase}_children"] = round(kids1 - kids0, 3)
        row[f"{phase}_wall"] = round(time.monotonic() - t0, 3)

    def pytest_runtest_logfinish(self, nodeid, location):
        row = self.rows.get(nodeid)
        if row is not None:
            row["cpu"] = round(sum(v for k, v in row.items() if k.endswith(("_self", "_children"))), 3)
            self._write()  # after every test, so a long run can be read while it goes

    def _write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"load_at_end": os.getloadavg(), "tests": self.rows}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def register(config) -> None:
    path = os.environ.get("LOONGFORGE_CPU_TIMES")
    if path:
        config.pluginmanager.register(CpuTimes(path), "loongforge-cpu-times")
