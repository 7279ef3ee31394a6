"""How a rank stops on a signal, and what it says.

* SIGINT (Ctrl-C): `Interrupted` at once, wherever the main thread is; nothing is saved; exit 130
  with one line naming the last checkpoint and the command that resumes it.
* SIGTERM (a launcher stopping the survivors of a fault, a preempting scheduler, the elastic
  supervisor forwarding its own): with save-on-term (default) and inside the step loop, the
  handler only notes the time. The step in flight finishes on every rank: the step's all_gather
  carries each rank's vote (`vote()`), so all ranks see the same votes and stop after the same
  step (a rank that got no signal stops too). The trainer then writes a synchronous checkpoint if
  the last save's duration fits in what is left of the grace period (else one WARNING) and the
  rank exits EXIT_PREEMPTED (85); the resume is exact from that step. A timer bounds the whole
  stop: past the grace period the rank closes what it can and leaves with 143 (`latest` is moved
  only by a complete save, so a cut one leaves the previous checkpoint).
* SIGTERM outside the step loop (start-up, resume, the final save) or with --no-save-on-term:
  `Terminated` at once, exit 143.
* SIGTERM while the rank is tearing down after a failure (an exception raised in the step loop is
  being handled, or launch.py called `tearing_down()`): ignored. It is the launcher stopping the
  survivors of a peer's failure; raising here would replace that failure with a misleading
  "Terminated" and cut the teardown short.
After the first signal SIGTERM is ignored: launchers follow a Ctrl-C with a TERM, which must not
cut the teardown short.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time

from loongforge.train.resilience.exits import EXIT_TERMINATED, Interrupted, Terminated, bounded, exit_now
from loongforge.train.resilience.nan_guard import parse_injection

log = logging.getLogger(__name__)
INJECT_TERM_ENV = "LOONGFORGE_INJECT_TERM"  # test hook, "STEP[@RANK]": that rank SIGTERMs itself as STEP starts


class StopSignals:
    """The rank's SIGINT/SIGTERM handlers and the SIGTERM grace period (see the module docstring)."""

    def __init__(self, *, save_on_term: bool = True, grace_s: float = 60.0):
        self.save_on_term, self.grace_s = save_on_term, grace_s
        self._armed = False  # in the step loop: a SIGTERM is handled after the step in flight
        self._looped = False  # the step loop has started (a failure after it is torn down, not terminated)
        self.term_at: float | None = None  # monotonic time of the SIGTERM being handled
        self.closers: list = []  # what the grace timer closes when it expires
        self.on_request: list = []  # called once when a SIGTERM is noted (the watchdog stops judging)
        self._timer: threading.Timer | None = None
        self._inject: frozenset[int] = frozenset()

    def inject_for(self, rank: int) -> None:
        self._inject = parse_injection(os.environ.get(INJECT_TERM_ENV), rank)

    def at_step(self, step: int) -> None:
        """Test hook: a real SIGTERM to this process as an injected step starts (the handler takes it)."""
        if step in self._inject:
            os.kill(os.getpid(), signal.SIGTERM)

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_term)
            signal.signal(signal.SIGINT, self._on_int)
        return self

    @property
    def armed(self) -> bool:
        return self._armed

    @armed.setter
    def armed(self, value: bool) -> None:
        self._armed = value
        self._looped = self._looped or value

    @property
    def requested(self) -> bool:
        return self.term_at is not None

    def vote(self) -> tuple[float, float]:
        """(1.0 if this rank got SIGTERM, seconds of its grace period left); +inf left without one."""
        if self.term_at is None:
            return 0.0, math.inf
        return 1.0, self.grace_s - (time.monotonic() - self.term_at)

    def finish(self) -> None:
        """The stop is over (the rank is leaving): the grace timer must not cut the exit short."""
        if self._timer is not None:
            self._timer.cancel()

    def _on_int(self, signum, frame):
        _ignore(signal.SIGTERM, signal.SIGINT)
        raise Interrupted()

    def tearing_down(self) -> None:
        """The rank is leaving (launch.py, after the run ended either way): a SIGTERM now is ignored."""
        _ignore(signal.SIGTERM)

    def _on_term(self, signum, frame):
        if self._looped and not self.armed and sys.exc_info()[1] is not None:
            log.debug("SIGTERM while tearing down after %r: ignored", sys.exc_info()[1])
            return
        if not (self.armed and self.save_on_term):
            _ignore(signal.SIGTERM, signal.SIGINT)
            raise Terminated("stopped at once, --no-save-on-term" if not self.save_on_term else
                             "outside the step loop: start-up, resume or the final save")
        if self.term_at is not None:
            return
        self.term_at = time.monotonic()
        _ignore(signal.SIGTERM)
        log.warning("SIGTERM: finishing the step in flight on every rank, then a checkpoint (grace period %.0f s, "
                    "--term-grace-s; --no-save-on-term to stop at once)", self.grace_s)
        for cb in self.on_request:
            cb()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        log.error("SIGTERM: no checkpoint within the grace period (%.0f s, --term-grace-s): stopping without one; "
                  "`latest` stays on the previous checkpoint", self.grace_s)
        bounded(self.closers, 5.0, log)
        exit_now(EXIT_TERMINATED)


def _ignore(*signums) -> None:
    for s in signums:
        with contextlib.suppress(ValueError):  # not the main thread: nothing to change
            signal.signal(s, signal.SIG_IGN)


def stop_decision(votes, *, est_save_s: list[float]) -> tuple[bool, float, float]:
    """From every rank's (flag, seconds left) and estimated save time: (save?, seconds left, estimate).
    The same inputs on every rank (gathered), so every rank decides the same."""
    left = min((lft for flag, lft in votes if flag), default=math.inf)
    est = max(est_save_s, default=0.0)
    return est <= left, left, est


def record_stop(run_dir: str, **fields) -> None:
    """One {"event": "stop"} line in metrics.jsonl (rank 0): how the launch ended on a signal, which the
    elastic supervisor reads to report it and not relaunch."""
    rec = {"v": 1, "event": "stop", "t": time.time(), **fields}
    with contextlib.suppress(OSError), open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
