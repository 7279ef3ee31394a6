"""Cache fixtures: `daemons` starts real daemon processes (see cache_helpers.py)."""

from __future__ import annotations

import shutil
import signal

import pytest
from tests.cache.cache_helpers import DaemonProc


@pytest.fixture
def daemons(tmp_path):
    """Factory: daemons(root, index, name=..., ...) -> started DaemonProc; all stopped at teardown."""
    started: list[DaemonProc] = []

    def make(root, index, name="node-a", start=True, **kw) -> DaemonProc:
        d = DaemonProc(tmp_path / "nodes", root, index, name, **kw)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.proc is not None:
            d.stop(signal.SIGKILL)
    shutil.rmtree(tmp_path / "nodes", ignore_errors=True)
