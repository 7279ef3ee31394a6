"""The elastic supervisor's restart budget: `--max-restarts N` relaunches after faults within any
`--restart-window S` seconds (a sliding window), so a long run is not ended by its Nth fault over
days, while a crash loop still ends within minutes.

torchelastic's `--max-restarts` counts restarts over the job's life; its docs tell users of long
jobs to set it high. The window here is that count, replenished: a fault older than S seconds no
longer counts. `--restart-window 0` is torchelastic's lifetime count. Only faults spend it; a
scale-up, a node leaving on SIGTERM, or the supervisor's own stop never do.
"""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, clock=time.monotonic):
        if max_restarts < 0 or window_s < 0:
            raise ValueError("max_restarts and window_s must be >= 0")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._spent: deque[float] = deque()  # monotonic times of the relaunches still counted

    def in_window(self) -> int:
        now = self.clock()
        while self.window_s and self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        return len(self._spent)

    def spend(self) -> bool:
        """A fault: True (and counted) when one more relaunch is within the budget, else False."""
        if self.in_window() >= self.max_restarts:
            return False
        self._spent.append(self.clock())
        return True

    def describe(self) -> str:
        span = f"within {self.window_s:g} s" if self.window_s else "over the run"
        return f"restart {self.in_window()} of {self.max_restarts} {span}"
