"""Run observability: one JSONL line per step (RUN_DIR/metrics.jsonl, rank 0)
with every timer, the losses and the global sample ids consumed, plus a live
console line (step N/total, loss, samples/s, data-wait %, ETA, the last
validation metrics) and an end-of-run summary.

The console's samples/s and ETA come from the records' own step times, never
from when a record is written: records are written one step late and flushed
in pairs before a checkpoint (profiler.LateWriter), microseconds apart."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time

from loongforge.shared.errors import FormatError
from loongforge.shared.storage import write_bytes_atomic

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
METRICS_VERSION = 1


class MetricsLog:
    def __init__(self, run_dir: str, *, enabled: bool, resume: bool, log_every: int = 1, stream=None,
                 keep_below: int = 0, total_steps: int = 0, sinks: tuple = ()):
        self.enabled, self.log_every, self.total = enabled, log_every, total_steps
        self.sinks = sinks  # called with each row after it is written (tracking.Tracker.log_step)
        self.stream = stream or sys.stderr
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._f = None
        self._samples_since, self._seconds_since = 0, 0.0  # since the last console line
        self._val: dict = {}  # the last validation metrics (--eval-every)
        self._run = {"t0": time.perf_counter(), "steps": 0, "samples": 0, "seconds": 0.0, "first": None, "last": None}
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if resume and os.path.exists(self.path):
                _truncate_from(self.path, keep_below)  # steps after the checkpoint are re-run
            # Line-buffered append: a crash loses at most the line being written; resume appends.
            if not resume:
                open(self.path, "w").close()
            # O_APPEND always: a fault record another rank appends (watchdog.py) is never overwritten.
            self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if not self._f:
            return
        self._f.write(json.dumps({"v": METRICS_VERSION, **record}, separators=(",", ":")) + "\n")
        for sink in self.sinks:
            sink.log_step(record)
        self._count(record)
        if record["step"] % self.log_every == 0:
            self.stream.write(self._line(record) + "\n")
            self.stream.flush()

    def _count(self, record: dict) -> None:
        self._samples_since += record.get("samples", 0)
        self._seconds_since += record.get("step_s", 0.0)
        self._val.update({k: v for k, v in record.items() if k.startswith("val_")})
        run = self._run
        if not record.get("warmup"):  # the first step of a process (startup, compilation) is not the rate
            run["steps"] += 1
            run["samples"] += record.get("samples", 0)
            run["seconds"] += record.get("step_s", 0.0)
        run["first"] = run["first"] or (record["step"], record["loss"])
        run["last"] = (record["step"], record["loss"])

    def _line(self, record: dict) -> str:
        step = record["step"]
        rate = self._samples_since / max(self._seconds_since, 1e-9)
        self._samples_since, self._seconds_since = 0, 0.0
        wait = 100.0 * record["data_wait_s"] / max(record["step_s"], 1e-9)
        total = f"/{self.total}" if self.total else ""
        line = (f"step {step + 1:6d}{total}  loss {record['loss']:.4f}  {rate:8.1f} samples/s  "
                f"data-wait {wait:4.1f}%  step {record['step_s'] * 1e3:7.1f} ms")
        per_step = self._run["seconds"] / self._run["steps"] if self._run["steps"] else record["step_s"]
        if self.total > step + 1:
            line += f"  ETA {_duration(per_step * (self.total - step - 1))}"
        return line + "".join(f"  {k} {v:.4f}" for k, v in sorted(self._val.items()))

    def summary(self) -> str:
        """One line at the end of a run: steps, wall time, steady throughput, loss first -> last, last val."""
        run = self._run
        if run["last"] is None:
            return "run summary: no step trained"
        (s0, l0), (s1, l1) = run["first"], run["last"]
        rate = run["samples"] / run["seconds"] if run["seconds"] else 0.0
        line = (f"run summary: steps {s0 + 1}-{s1 + 1}{f'/{self.total}' if self.total else ''} in "
                f"{_duration(time.perf_counter() - run['t0'])}, {rate:.1f} samples/s (steady), loss {l0:.4f} -> "
                f"{l1:.4f}")
        return line + "".join(f", {k} {v:.4f}" for k, v in sorted(self._val.items()))

    def write_summary(self) -> None:
        if self._f:
            self.stream.write(self.summary() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._f:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _truncate_from(path: str, step: int) -> None:
    keep = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                if "event" in row or row["step"] < step:  # fault records stay: they are the run's history
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                continue
    write_bytes_atomic(path, "".join(keep).encode())


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise FormatError(f"{path} not found: not a run directory (run `loongforge train --run-dir DIR` first)")
    rows = []
    with open(path) as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if n == 1:
                raise
            torn = n == len(lines) and not line.endswith("\n")
            log.warning("%s:%d: %s; skipped", path, n, "torn last line (the run was killed mid-write)" if torn
                        else f"not a JSON row ({line[:80]!r}): a corrupt file")
            continue
        if row.get("v") != METRICS_VERSION:
            raise FormatError(f"{path}:{n}: metrics version {row.get('v')!r}, this build reads {METRICS_VERSION}")
        if "event" in row:  # a fault record (watchdog.py, elastic.py): read_events
            continue
        rows.append(row)
    return rows


def read_events(run_dir: str) -> list[dict]:
    """The fault records of metrics.jsonl ({"event": ...}), in order."""
    path = os.path.join(run_dir, METRICS_FILE)
    out = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and "event" in row:
                    out.append(row)
    return out
