"""Cache fixtures: `daemons` starts real daemon processes (see cache_helpers.py)."""

from __future__ import annotations

import shutil
import signal

import pytest
from tests.cache.cache_helpers import DaemonProc
from tests.cache.users import made_users


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


@pytest.fixture(scope="session")
def users():
    """Throwaway Unix users: the daemon's (`d`), a member of its group (`inn`), an outsider (`out`).
    Skipped without root (see users.py)."""
    with made_users() as made:
        yield made
