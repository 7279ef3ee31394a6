"""One preprocess job on its runner (runner/choice.py says which), from start to summary:
the runner's options, the runner object, progress lines, and what the summary says about
the run (counters; on Dask, the conversion attempts per worker)."""

from __future__ import annotations

import contextlib
import logging
import uuid

from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.runners.portability.fn_api_runner import fn_runner
from google.protobuf import struct_pb2

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.runner.dask_job import DaskSession
from loongforge.preprocess.stages.pack import METRICS_NS
from loongforge.preprocess.runner.progress import EpisodeEvents, ProgressMonitor
from loongforge.shared.summary import output_counters
from loongforge.preprocess.runner.choice import RunnerConfig, dask_partition_size
from loongforge.shared.errors import ConfigError

log = logging.getLogger(__name__)
# What local worker processes log: warnings, plus this job's own progress lines
# (Beam's harness otherwise prints ~15 INFO lines of gRPC set-up per worker).
WORKER_LOG_LEVELS = {"default_sdk_harness_log_level": "WARNING",
                     "sdk_harness_log_level_overrides": {"loongforge": "INFO", "__main__": "ERROR"}}


def beam_options(cfg: PreprocessConfig, runner: RunnerConfig, beam_args: list[str], episodes: int,
                 dask_address: str = "") -> PipelineOptions:
    """The runner's options: ours for what we set up, the caller's own flags win."""
    given = {a.split("=", 1)[0] for a in beam_args}
    flags = [*beam_args, f"--runner={runner.beam_name}"]
    if runner.kind == "local":
        # Beam's default DirectRunner may fetch a Prism binary (fails offline): the local runner is FnApiRunner.
        if "--direct_num_workers" not in given:
            flags.append(f"--direct_num_workers={cfg.num_workers}")
        if "--direct_running_mode" not in given:
            flags.append("--direct_running_mode=multi_processing")
    elif runner.kind == "dask":
        try:  # optional dependency (the dask extra); importing it also registers Beam's --dask_* options
            import apache_beam.runners.dask.dask_runner  # noqa: F401
        except ImportError as exc:
            raise ConfigError("--runner dask needs the dask extra: pip install 'loongforge[preprocess-dask]' "
                              f"({exc})") from exc
        flags.append(f"--dask_client_address={dask_address}")
        if not given & {"--dask_npartitions", "--dask_partition_size"}:
            flags.append(f"--dask_partition_size={dask_partition_size(episodes)}")
    return PipelineOptions(flags=flags)


def local_runner(options: PipelineOptions):
    """The FnApiRunner with worker log levels. FnApiRunner hands its workers only the
    options in its provision info, so they go there."""
    worker_options = struct_pb2.Struct()
    worker_options.update(WORKER_LOG_LEVELS)
    info = beam_provision_api_pb2.ProvisionInfo(pipeline_options=worker_options)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(info))


def job_counters(result) -> dict[str, int]:
    """This job's Beam counters (METRICS_NS), summed over steps; {} where the
    runner does not report them."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NS))["counters"]
    except (AttributeError, NotImplementedError, KeyError):
        return {}
    out: dict[str, int] = {}
    for r in found:
        value = r.committed if r.committed is not None else r.attempted
        out[r.key.metric.name] = out.get(r.key.metric.name, 0) + int(value or 0)
    return dict(sorted(out.items()))


class Launch:
    """One job on its runner, from start to summary: the options, the runner object, the
    progress lines, and what the summary says about the run. A context manager: a Dask
    session (client, local cluster) is closed on every exit path."""

    def __init__(self, cfg: PreprocessConfig, runner: RunnerConfig, beam_args: list[str], lengths: dict[int, int],
                 cameras: int):
        self.cfg, self.runner, self.beam_args, self.lengths, self.cameras = cfg, runner, beam_args, lengths, cameras
        dask = runner.kind == "dask"
        # The convert tasks report to a topic of this job's own (a scheduler may serve several jobs).
        self.progress_topic = f"loongforge-preprocess-{uuid.uuid4().hex[:16]}" if dask else ""
        self.events = EpisodeEvents() if dask else None
        self.dask = DaskSession(runner.dask_scheduler, cfg.num_workers, self.progress_topic, self.events) if dask \
            else None
        self.options = self.beam_runner = self.monitor = self.result = None

    def __enter__(self) -> "Launch":
        try:
            if self.dask is not None:
                self.dask.start()
            self.options = beam_options(self.cfg, self.runner, self.beam_args, len(self.lengths),
                                        self.dask.address if self.dask else "")
        except BaseException:  # a cluster that failed its checks: its client (and a local cluster) still close
            self.__exit__(None, None, None)
            raise
        self.beam_runner = local_runner(self.options) if self.runner.kind == "local" else None
        if self.cfg.progress_s > 0 and self.runner.kind in ("local", "direct", "dask"):
            self.monitor = ProgressMonitor(self.cfg.output, self.lengths, self.cameras, self.cfg.progress_s,
                                           finished=self.events.finished if self.events else None)
        return self

    def run(self, pipeline):
        """Run the pipeline to completion; a runner's failure the launcher can explain is re-raised as one."""
        with self.monitor if self.monitor is not None else contextlib.nullcontext():
            self.result = pipeline.run()
            try:
                self.result.wait_until_finish()
            except Exception as exc:
                err = self.dask.explain(exc) if self.dask is not None else None
                if err is None:
                    raise
                raise err from exc
        return self.result

    def report(self, summary: dict) -> dict:
        """The summary's account of the run: counters (Beam's, or from the outputs where the runner
        reports none), and on Dask the conversion attempts per worker."""
        out = {"counters": job_counters(self.result) or output_counters(self.cfg.output, summary)}
        if self.dask is not None:
            self.dask.settle(summary["episodes"] + summary["failed"])
            out["conversions"] = self.events.conversions()
        if self.monitor is not None:
            self.monitor.finish(summary["episodes"], summary["failed"], summary["source_frames"] * self.cameras)
        return out

    def __exit__(self, *exc) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.dask is not None:
            self.dask.close(self.result)
