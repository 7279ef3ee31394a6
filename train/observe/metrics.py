"""Run observability: one JSONL line per step (RUN_DIR/metrics.jsonl, rank 0)
with every timer, the losses and the global sample ids consumed, plus a live
console line (step, loss, samples/s, data-wait %)."""

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
                 keep_below: int = 0):
        self.enabled, self.log_every = enabled, log_every
        self.stream = stream or sys.stderr
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._f = None
        self._t_last, self._samples_since = time.perf_counter(), 0
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
        self._samples_since += record.get("samples", 0)
        step = record["step"]
        if step % self.log_every == 0:
            now = time.perf_counter()
            rate = self._samples_since / max(now - self._t_last, 1e-9)
            self._t_last, self._samples_since = now, 0
            wait = 100.0 * record["data_wait_s"] / max(record["step_s"], 1e-9)
            self.stream.write(f"step {step:6d}  loss {record['loss']:.4f}  {rate:8.1f} samples/s  "
                              f"data-wait {wait:4.1f}%  step {record['step_s'] * 1e3:7.1f} ms\n")
            self.stream.flush()

    def close(self) -> None:
        if self._f:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


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
