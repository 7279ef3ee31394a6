"""Timing primitives: repeat a measurement, summarise it, time a loader pass.

Shared machines are noisy, so every figure is reported as the median of
`repeats` runs with its min-max spread, and every comparison is a ratio of two
figures measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Stat:
    median: float
    min: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> "Stat":
        vals = tuple(float(v) for v in values)
        if not vals:
            raise ValueError("Stat.of needs at least one value")
        return cls(statistics.median(vals), min(vals), max(vals), vals)

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "values": list(self.values)}


def ratio(num: Stat, den: Stat) -> Stat:
    """Ratio of medians, with the spread the two spreads allow (worst to best case)."""
    if den.median == 0 or den.min == 0 or den.max == 0:
        return Stat(float("inf"), float("inf"), float("inf"), ())
    return Stat(num.median / den.median, num.min / den.max, num.max / den.min, ())


@dataclass(slots=True)
class PassTiming:
    """One timed pass over a loader: the first `warmup` batches are excluded."""

    samples: int = 0
    seconds: float = 0.0
    startup_s: float = 0.0  # from iter() to the end of the warm-up (worker start-up and settling included)
    settle_batches: int = 0  # untimed batches after the warm-up: those decoded ahead while workers started
    cpu_s: float = 0.0  # CPU seconds of the process tree over the timed batches (0 without a meter)
    wait_s: list[float] = field(default_factory=list)  # per timed batch: time blocked in next()

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_cpu_s(self) -> float:
        """Samples per CPU-second: samples/s per busy core, however many cores the pass spread over."""
        return self.samples / self.cpu_s if self.cpu_s > 0 else 0.0

    @property
    def busy_cores(self) -> float:
        return self.cpu_s / self.seconds if self.seconds > 0 else 0.0


def batch_size_of(batch) -> int:
    """Samples in a batch dict of tensors/arrays (first array-like field's leading dim)."""
    for value in batch.values():
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) >= 1:
            return int(shape[0])
    if isinstance(next(iter(batch.values()), None), list):
        return len(next(iter(batch.values())))
    raise ValueError("cannot tell the batch size: no array field in the batch")


def endless(make_iter: Callable[[], Iterable]) -> Iterator:
    """Batches from successive epochs, so a timed pass never runs dry on a small dataset."""
    while True:
        got = False
        for batch in make_iter():
            got = True
            yield batch
        if not got:
            raise RuntimeError("the loader yielded no batch in a whole epoch")


def time_pass(batches: Iterator, *, warmup: int, timed: int,
              on_batch: Callable[[object], None] | None = None, meter=None,
              ready: Callable[[], int] | None = None) -> PassTiming:
    """Pull `warmup` then `timed` batches from `batches`; `on_batch` runs on each
    timed batch after the wait (the model step in a training loop). `meter`
    (a cores.CpuMeter) counts CPU seconds over the timed batches only. `ready`
    (e.g. the loader's wait_ready), called after the warm-up, blocks until every
    worker is up and returns how many batches were decoded ahead meanwhile; those
    are pulled untimed too (`settle_batches`), so neither a worker's start-up nor
    a queue filled during it lands in the timed window."""
    out = PassTiming()
    t0 = time.perf_counter()
    for _ in range(warmup):
        next(batches)
    if ready is not None:
        out.settle_batches = ready()
        for _ in range(out.settle_batches):
            next(batches)
    out.startup_s = time.perf_counter() - t0
    if meter is not None:
        meter.start()
    start = time.perf_counter()
    for _ in range(timed):
        t = time.perf_counter()
        batch = next(batches)
        out.wait_s.append(time.perf_counter() - t)
        out.samples += batch_size_of(batch)
        if on_batch is not None:
            on_batch(batch)
    out.seconds = time.perf_counter() - start
    if meter is not None:
        out.cpu_s = meter.stop()
    return out
