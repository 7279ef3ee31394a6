"""`loongforge bench NAME`: one subcommand per benchmark, each with its own options and --help;
no name lists them and exits 2; `python -m loongforge.benchmarks` is the same command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loongforge.benchmarks.cli import BENCHMARKS

LOONGFORGE = str(Path(sys.executable).parent / "loongforge")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, env={**os.environ})


def test_scale_help_is_scales_own():
    got = _run(LOONGFORGE, "bench", "scale", "--help")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage: loongforge bench scale")
    assert "--project-to" in got.stdout and "--plan" in got.stdout and "--ranks" in got.stdout
    assert "--gops" not in got.stdout and "--quick" not in got.stdout  # not the data benchmark's options


def test_ablation_help_is_ablations_own_and_so_through_python_m():
    got = _run(sys.executable, "-m", "loongforge.benchmarks", "ablation", "--help")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage: python -m loongforge.benchmarks ablation")
    assert "--rows" in got.stdout and "--order" in got.stdout and "--project-to" not in got.stdout


@pytest.mark.parametrize("argv", [[LOONGFORGE, "bench"], [sys.executable, "-m", "loongforge.benchmarks"]])
def test_no_name_lists_the_benchmarks_and_exits_2(argv):
    got = _run(*argv)
    assert got.returncode == 2
    for name in ("data", "scale", "ablation", "faults", "ckpt", "storage", "index-scale", "order-scale",
                 "conversion", "checksum-cost", "gpu-check"):
        assert name in got.stderr, name


def test_every_benchmark_parses_its_own_options_and_routes_to_its_module():
    from loongforge.cli import build_parser

    p = build_parser()
    data = p.parse_args(["bench", "data", "--quick", "--workers", "0,1"])
    assert data.func.__module__ == "loongforge.benchmarks.harness.run" and data.workers == (0, 1) and data.quick
    abl = p.parse_args(["bench", "ablation", "--ranks", "8", "--rows", "0,C10"])
    assert abl.func.__module__ == "loongforge.benchmarks.ablation.cli" and (abl.ranks, abl.rows) == (8, ("0", "C10"))
    for name, (module, _) in BENCHMARKS.items():
        argv = ["bench", name] + (["SHARDS"] if name == "checksum-cost" else [])
        assert p.parse_args(argv).func.__module__ == module, name


def test_a_bad_option_is_a_usage_error_of_that_benchmark():
    got = _run(LOONGFORGE, "bench", "scale", "--gops", "2")
    assert got.returncode == 2 and "usage: loongforge bench scale" in got.stderr
