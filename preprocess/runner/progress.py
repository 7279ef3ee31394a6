"""Progress of a running job: a line every few seconds on the local and the Dask runner.

    progress: 12/40 episodes (1 failed), 2,310 frames/s, ETA 0:00:31

Local runner: the launcher cannot read Beam metrics before the job ends
(FnApiRunner reports them with the result), and workers are separate
processes, so the convert stage's own output is the shared state: every
finished episode leaves `_staging/episode_NNNNNN.bin` (converted, written
atomically) or `_staging/episode_NNNNNN.failed` (a marker). A launcher thread
counts them. Frames come from episodes.jsonl's lengths (unknown lengths: no
frames/s, episodes only).

Dask runner: each conversion attempt reports itself from the task, as an event on
the job's own topic (`report_episode`, dask's `Worker.log_event`); the launcher's
client subscribes to it (`EpisodeEvents`). The same events say which worker
converted which episode, and how often: the summary's `conversions`.

Dataflow: the same numbers are the job's Beam counters (namespace
`loongforge.preprocess`: episodes_converted, episodes_failed, frames_decoded,
samples, shards_written, shard_bytes_written), shown live under "Custom
counters" in the Dataflow console; `run_job` also returns them in the summary.
"""

from __future__ import annotations

import collections
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from loongforge.preprocess import files
from loongforge.preprocess.stages.pack import STAGING_DIR

log = logging.getLogger(__name__)
_DONE = re.compile(r"(?:^|/)episode_(\d{6})\.(bin|failed)$")  # not the .tmp-* files of atomic writes


@dataclass(frozen=True, slots=True)
class Progress:
    done: int  # converted + failed
    failed: int
    total: int
    frames: int  # source frames of the converted episodes, all cameras
    elapsed_s: float

    def line(self) -> str:
        text = f"progress: {self.done}/{self.total} episodes ({self.failed} failed)"
        if self.frames and self.elapsed_s > 0:
            text += f", {self.frames / self.elapsed_s:,.0f} frames/s"
        if 0 < self.done < self.total:
            eta = self.elapsed_s / self.done * (self.total - self.done)
            text += f", ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        elif self.done >= self.total:
            text += f", done in {self.elapsed_s:.1f} s"
        return text


def staging_files(output: str) -> tuple[set[int], set[int]]:
    """(converted, failed) episodes, from the staging files under `output`."""
    try:
        names = files.list_files(output, STAGING_DIR)
    except (FileNotFoundError, OSError):  # not created yet, or already cleaned up
        names = set()
    ok, failed = set(), set()
    for name in names:
        m = _DONE.search(name)
        if m:
            (failed if m.group(2) == "failed" else ok).add(int(m.group(1)))
    return ok, failed


def report_episode(topic: str, episode: int, ok: bool) -> None:
    """Worker side, after each conversion attempt: an event on `topic` when this runs in a
    dask worker's task; nothing anywhere else (other runners have their own channels)."""
    if not topic:
        return
    distributed = sys.modules.get("distributed")  # loaded in every dask worker; never imported here
    if distributed is None:
        return
    try:
        worker = distributed.get_worker()
    except ValueError:  # not inside a dask task
        return
    worker.log_event(topic, {"episode": int(episode), "ok": bool(ok), "worker": worker.address,
                             "attempt": uuid.uuid4().hex})


class EpisodeEvents:
    """Launcher side: the attempts reported on one topic (`handle` is the dask client's
    subscription handler; it runs on the client's thread). An attempt counts once,
    however it arrived (live, or from the scheduler's log at the end)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[str, dict] = {}

    def handle(self, event) -> None:
        _, msg = event  # (scheduler timestamp, message)
        with self._lock:
            self._seen.setdefault(str(msg["attempt"]), dict(msg))

    def attempts(self) -> list[dict]:
        with self._lock:
            return list(self._seen.values())

    def finished(self) -> tuple[set[int], set[int]]:
        """(converted, failed) episodes; an episode that failed once and converted on a retry is converted."""
        ok = {a["episode"] for a in self.attempts() if a["ok"]}
        return ok, {a["episode"] for a in self.attempts() if not a["ok"]} - ok

    def conversions(self) -> dict:
        """What the summary reports: attempts, by worker, and the episodes converted more than once."""
        attempts = self.attempts()
        per_episode = collections.Counter(a["episode"] for a in attempts)
        return {"attempts": len(attempts),
                "by_worker": dict(sorted(collections.Counter(a["worker"] for a in attempts).items())),
                "repeated": sorted(e for e, n in per_episode.items() if n > 1)}


class ProgressMonitor:
    """Counts finished episodes every `interval_s` and emits a line: from the staging files
    under `output`, or from `finished()` -> (converted, failed) where the runner has a channel.
    `lengths`: episode -> source frames (-1 unknown), one entry per input episode.
    Use as a context manager around the pipeline run; `finish()` emits the last line."""

    def __init__(self, output: str, lengths: dict[int, int], cameras: int, interval_s: float,
                 emit: Callable[[str], None] = log.info, clock: Callable[[], float] = time.monotonic,
                 finished: Callable[[], tuple[set[int], set[int]]] | None = None):
        self.output, self.lengths, self.cameras = output, lengths, cameras
        self.interval_s, self.emit, self.clock = interval_s, emit, clock
        self.finished = finished or (lambda: staging_files(output))
        self.t0 = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loongforge-progress", daemon=True)

    def snapshot(self) -> Progress:
        ok, failed = self.finished()
        frames = sum(max(0, self.lengths.get(e, 0)) for e in ok) * self.cameras
        return Progress(done=len(ok | failed), failed=len(failed), total=len(self.lengths), frames=frames,
                        elapsed_s=self.clock() - self.t0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.emit(self.snapshot().line())

    def finish(self, converted: int, failed: int, frames: int) -> None:
        """The last line, from the job's own totals (the staging files are gone by then)."""
        self.close()
        self.emit(Progress(done=converted + failed, failed=failed, total=len(self.lengths), frames=frames,
                           elapsed_s=self.clock() - self.t0).line())

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> "ProgressMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
