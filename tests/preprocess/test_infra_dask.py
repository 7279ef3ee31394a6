"""infra/dask (no container runtime here): its commands are the ones the cluster tests run, and
its image copies every folder the install needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra" / "dask"
ROOT = INFRA.parents[1]


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def test_compose_runs_the_scheduler_workers_and_launcher_from_one_image():
    from distributed.cli.dask_scheduler import main as scheduler_cli
    from distributed.cli.dask_worker import main as worker_cli

    services = _compose()["services"]
    assert set(services) == {"scheduler", "worker", "launcher"}
    assert {s["image"] for s in services.values()} == {"loongforge-dask:latest"}
    assert {s["build"]["dockerfile"] for s in services.values()} == {"infra/dask/Dockerfile"}
    scheduler, worker = services["scheduler"]["command"], services["worker"]["command"]
    assert scheduler[:2] == ["dask", "scheduler"] and worker[:3] == ["dask", "worker", "tcp://scheduler:8786"]
    assert {a for a in scheduler if a.startswith("--")} <= _options(scheduler_cli)
    assert {a for a in worker if a.startswith("--")} <= _options(worker_cli)
    assert worker[worker.index("--nthreads") + 1] == "1"  # one episode at a time per process


def test_compose_launcher_is_a_valid_preprocess_command():
    from loongforge.cli import build_parser
    from loongforge.preprocess.runner.choice import RunnerConfig, runner_from_args

    command = _compose()["services"]["launcher"]["command"]
    args = build_parser().parse_args(command[1:])
    runner, beam_args = runner_from_args(args, [a for a in args.beam_args if a != "--"])
    assert runner == RunnerConfig(name="dask", dask_scheduler="tcp://scheduler:8786") and beam_args == []


def test_image_copies_every_package_folder_of_the_install():
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
                       .values())
    copied = set(re.findall(r"^COPY (\S+) \1$", (INFRA / "Dockerfile").read_text(), re.M))
    assert package_dirs <= copied and all((ROOT / d).is_dir() for d in copied)
    allowed = {line[1:] for line in (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert package_dirs | {"pyproject.toml", "README.md"} <= allowed
