"""How a rank ends: its exit codes, SIGTERM as a clean teardown, and `exit_now`.

gloo processes sometimes abort at interpreter exit ("terminate called without an active
exception"), so after the process group is destroyed a rank flushes and leaves with
os._exit(code): a launch returns the run's real exit code, reliably. The watchdog leaves the
same way when a peer fails, without waiting for a main thread that may be blocked in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

EXIT_CONFIG = 2  # a usage or config error, found before any process group
EXIT_PEER_FAULT = 75  # EX_TEMPFAIL: "retry without the failed rank"; the elastic supervisor relaunches on it
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` closes the loader (its decode workers and
    shared-memory slots) instead of the process vanishing mid-step."""


def terminate_cleanly() -> None:
    """Turn SIGTERM into `Terminated` in the main thread. Launchers send SIGTERM to every rank when one
    fails (deepspeed's to the whole process tree, torchrun's before SIGKILL after a grace period), and
    so does a preempting scheduler."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one teardown; a second TERM must not cut it short
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
