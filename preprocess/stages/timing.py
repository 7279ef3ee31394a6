"""Which video frame each parquet row shows: the frame nearest the row's timestamp, LeRobot's rule.

LeRobotDataset (and GR00T's loader) decode, for row r of an episode, the frame whose presentation
time is nearest `from_timestamp + timestamp[r]` (v3.0; `timestamp[r]` in v2.x) and refuse one
farther than `tolerance_s` (1e-4 s). Preprocess stores that frame as row r's, so an item's image
and its `timestamp` agree whatever the stamps are: stamps 0, 1/fps, 2/fps, ... map row r to the
episode's frame r (the identity: the stored bytes are the same as a plain frame count gives);
GR00T's demo data, stamped from 1/fps, maps row r to frame r + 1; wall-clock stamps with jitter or
dropped frames map where they point.

Two things LeRobot does that this does not: candidates are the frames of the row's own episode
only (its span of a shared v3.0 file), so a row never shows a neighbour's frame (LeRobot shows the
next episode's first frame for a row stamped past its episode's last frame); and distances are
float64 (LeRobot's are float32, ~8 us of resolution at 100 s into a file). A row with no frame
within the tolerance follows `mismatch`: "clamp" (the nearest frame of the episode), "skip" (the
row is left out of the episode), "fail" (the episode becomes a failed record). Per camera the
rows are counted: shifted (within tolerance, a frame other than the row's own position), clamped,
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError

MISMATCH_POLICIES = ("clamp", "skip", "fail")
DEFAULT_TOLERANCE_S = 1e-4  # LeRobotDataset's default tolerance_s


@dataclass(frozen=True, slots=True)
class FrameTiming:
    """How rows meet frames: the tolerance of a match and what a row without one gets."""

    tolerance_s: float = DEFAULT_TOLERANCE_S
    mismatch: str = "clamp"

    def __post_init__(self):
        if not self.tolerance_s > 0:
            raise ConfigError(f"timestamp tolerance {self.tolerance_s!r} s: must be > 0 (LeRobot's is 1e-4)")
        if self.mismatch not in MISMATCH_POLICIES:
            raise ConfigError(f"frame mismatch {self.mismatch!r}: choose one of {MISMATCH_POLICIES}")


@dataclass(frozen=True, slots=True)
class RowFrames:
    """One camera's mapping of an episode: per row the frame it shows (its position among the
    episode's frames, -1 where the row is skipped), and the counts."""

    frame: np.ndarray  # int64 (n,)
    shifted: int
    clamped: int
    skipped: int
    frames_seen: int  # frames the episode's span holds

    def counts(self) -> tuple[int, int, int]:
        return self.shifted, self.clamped, self.skipped


class FrameMismatch(Exception):
    """A row with no frame within the tolerance, under mismatch "fail"."""

    def __init__(self, row: int, query: float, nearest: float, tolerance_s: float):
        super().__init__(f"row {row} at {query:.6f} s has no frame within {tolerance_s:g} s (the episode's nearest "
                         f"is at {nearest:.6f} s, {abs(query - nearest):.6f} s away)")


class NearestFrames:
    """Rows -> the nearest frame, fed the frames in presentation order, one held at a time.

    `push(frame)` returns the rows the PREVIOUS frame serves (those nearer to it than to this one;
    an exact tie goes to the earlier frame, as LeRobot's argmin) once this frame shows where its
    reach ends; `finish()` hands the remaining rows to the last frame. So the caller converts each
    needed frame once, while decoding front to back, and never keeps more than one decoded frame."""

    def __init__(self, queries: np.ndarray, timing: FrameTiming):
        self.queries = np.asarray(queries, np.float64)
        self.order = np.argsort(self.queries, kind="stable")
        self.sorted = self.queries[self.order]
        self.timing = timing
        self.frame = np.full(len(self.queries), -1, np.int64)
        self.done, self.seen = 0, 0
        self.prev: tuple[float, object] | None = None
        self.shifted = self.clamped = self.skipped = 0

    def push(self, time: float, payload) -> tuple[np.ndarray, object] | None:
        served = None
        if self.prev is not None:
            prev_time, prev_payload = self.prev
            end = int(np.searchsorted(self.sorted, prev_time + (time - prev_time) / 2, side="right"))
            served = self._assign(end, prev_time), prev_payload
        self.prev = (time, payload)
        self.seen += 1
        return served

    def finish(self) -> tuple[np.ndarray, object] | None:
        if self.prev is None:
            return None
        prev_time, prev_payload = self.prev
        return self._assign(len(self.sorted), prev_time), prev_payload

    def _assign(self, end: int, time: float) -> np.ndarray:
        """Rows [done, end) of the sorted order go to frame `seen - 1`; the ones it may show."""
        rows = self.order[self.done:end]
        self.done = max(self.done, end)
        ordinal = self.seen - 1
        off = np.abs(self.queries[rows] - time) >= self.timing.tolerance_s  # LeRobot: within is dist < tol
        if off.any():
            if self.timing.mismatch == "fail":
                r = int(rows[np.flatnonzero(off)[0]])
                raise FrameMismatch(r, float(self.queries[r]), time, self.timing.tolerance_s)
            if self.timing.mismatch == "skip":
                self.skipped += int(off.sum())
                rows, off = rows[~off], off[~off]
            else:
                self.clamped += int(off.sum())
        self.frame[rows] = ordinal
        self.shifted += int(((rows != ordinal) & ~off).sum())
        return rows

    def result(self) -> RowFrames:
        return RowFrames(self.frame, self.shifted, self.clamped, self.skipped, self.seen)
