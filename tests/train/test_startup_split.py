"""Every launch's first step records where its start-up went (`startup` in metrics.jsonl), which
`loongforge bench startup` folds into its columns: read from the shared 2-rank run (conftest.zero3_run)."""

from __future__ import annotations

import pytest

from loongforge.benchmarks.micro.startup import COLUMNS, split
from tests.train.train_launch import read_metrics


def test_the_first_step_records_the_phases_from_process_start(zero3_run):
    rows = [r for r in read_metrics(zero3_run) if "step" in r]
    first, rest = rows[0], rows[1:]
    assert first["warmup"] and "startup" in first and not any("startup" in r for r in rest)
    s = first["startup"]
    phases = s["phases_s"]
    # the trainer's phases in order, each non-negative, together from the process's start to the step's end
    assert list(phases) == ["imports", "setup", "preflight", "init_distributed", "parallelize", "build_model",
                            "loader", "first step"]
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(s["first_step_end"] - s["process_start"], abs=0.02)
    assert phases["first step"] >= first["step_s"] - 0.02  # the step is inside it
    # the benchmark's columns take every phase once
    cols = split(s)
    assert set(cols) == set(COLUMNS)
    assert sum(cols.values()) == pytest.approx(sum(phases.values()), abs=0.02)
