"""Which Beam runner runs the preprocess job, and what the launcher does around it.

    loongforge preprocess --input D --output S                                   # local (default)
    loongforge preprocess --input D --output S --runner dask --dask-scheduler tcp://HOST:8786
    loongforge preprocess --input gs://B/D --output gs://B/S --runner dataflow -- --project=P --region=R

`--runner` takes the short names of RUNNERS, or any runner name Beam knows (or a dotted
class path), passed to Beam unchanged; the Beam options after `--` go to Beam unchanged.
Run by this project's tests: local, direct, dask. Flags only (no such cluster reachable
from the test machines): dataflow, flink, spark.

What the launcher adds per runner:
  local   FnApiRunner, one worker process per --workers, quiet worker logs; progress from
          the staging files.
  direct  Beam's DirectRunner as Beam sets it up; progress from the staging files.
  dask    Beam's DaskRunner on --dask-scheduler (default: a local cluster of --workers
          single-threaded processes, for the job's duration); one episode per task; progress
          and conversion counts from the tasks' own events (runner/progress.py); summary counters
          from the outputs (the runner reports no metrics). runner/dask_job.py checks the cluster.
  other   Beam's defaults; the summary has Beam's counters where the runner reports them.

This module holds the choice (no Beam import: `loongforge --help` stays light);
runner/launch.py sets the runner up and runs the job on it.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from loongforge.shared.errors import ConfigError

# The names users type -> Beam's runner names.
RUNNERS = {
    "local": "FnApiRunner",  # Beam's portable runner in-process, worker processes on this machine
    "direct": "DirectRunner",
    "dask": "apache_beam.runners.dask.dask_runner.DaskRunner",  # a dask.distributed cluster (apache-beam[dask])
    "dataflow": "DataflowRunner",
    "flink": "FlinkRunner",  # needs Beam's Flink job server
    "spark": "SparkRunner",  # needs Beam's Spark job server
}
# Beam's class name, which Beam itself does not know without the module path.
ALIASES = {"daskrunner": "dask"}
# The Dask runner puts up to 128 elements of a Create in one task (one worker); the job wants one
# episode per task, up to this many tasks (a few episodes per task beyond).
DASK_MAX_EPISODE_TASKS = 4096
_ADDRESS = re.compile(r"(?:[a-z]+://)?(?:\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):\d+")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerConfig:
    name: str = "local"  # a RUNNERS key, or any runner name Beam accepts (passed through)
    dask_scheduler: str = ""  # dask: the scheduler's address; "" = a local cluster of --workers processes

    def __post_init__(self):
        if not self.name.strip():
            raise ConfigError(f"--runner: empty; choose one of {', '.join(RUNNERS)} or a Beam runner name")
        if self.dask_scheduler and self.kind != "dask":
            raise ConfigError(f"--dask-scheduler {self.dask_scheduler}: only with --runner dask (not {self.name})")
        if self.dask_scheduler and not _ADDRESS.fullmatch(self.dask_scheduler):
            raise ConfigError(f"--dask-scheduler {self.dask_scheduler!r}: give the scheduler's address, e.g. "
                              "tcp://10.0.0.5:8786")

    @property
    def beam_name(self) -> str:
        key = ALIASES.get(self.name.lower(), self.name.lower())
        return RUNNERS.get(key, self.name)

    @property
    def kind(self) -> str:
        """local, dask, direct, or other: what the launcher does around the runner."""
        by_beam_name = {RUNNERS["local"]: "local", RUNNERS["dask"]: "dask", RUNNERS["direct"]: "direct"}
        return by_beam_name.get(self.beam_name, "other")


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", default=None, metavar="NAME",
                        help="local (default: FnApiRunner, one process per core), direct, dask, dataflow, flink, "
                        "spark, or any Beam runner name (passed through)")
    parser.add_argument("--dask-scheduler", default="", metavar="ADDRESS",
                        help="--runner dask: the dask.distributed scheduler, e.g. tcp://HOST:8786 (default: a local "
                        "cluster of --workers processes for the job's duration)")


def _pop_flag(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """(value of `flag` in args or None, args without it): `--flag V` and `--flag=V`."""
    value, rest, it = None, [], iter(args)
    for a in it:
        if a == flag:
            value = next(it, "")
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return value, rest


def runner_from_args(args: argparse.Namespace, beam_args: list[str]) -> tuple[RunnerConfig, list[str]]:
    """The runner choice and the Beam options left to pass through. `--runner` and
    `--dask_client_address` may also come among the Beam options (after `--`)."""
    runner, rest = _pop_flag(beam_args, "--runner")
    scheduler, rest = _pop_flag(rest, "--dask_client_address")
    for ours, theirs, flag in ((args.runner, runner, "--runner"), (args.dask_scheduler, scheduler, "--dask-scheduler")):
        if ours and theirs and ours != theirs:
            raise ConfigError(f"{flag} {ours} and the Beam option {theirs}: give one")
    return RunnerConfig(name=args.runner or runner or "local",
                        dask_scheduler=args.dask_scheduler or scheduler or ""), rest


def dask_partition_size(episodes: int) -> int:
    return max(1, math.ceil(episodes / DASK_MAX_EPISODE_TASKS))
