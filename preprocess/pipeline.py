"""The preprocess job: LeRobot dataset (v2.0/v2.1/v3.0: parquet + mp4 or images) -> NV12 shards + index (FORMAT.md).

Local (default runner: Beam's FnApiRunner, one worker process per core):

    loongforge preprocess --input data/sample --output out/shards
    python -m loongforge.preprocess.pipeline --input data/sample --output out/shards --workers 2

Dataflow (standard Beam pipeline options pass straight through; see
infra/dataflow/launch.sh for the full command):

    python -m loongforge.preprocess.pipeline --input gs://bkt/lerobot/ds --output gs://bkt/shards/ds \\
        --runner=DataflowRunner --project=P --region=us-central1 --temp_location=gs://bkt/tmp \\
        --setup_file=$PWD/pyproject.toml --requirements_file=infra/dataflow/requirements.txt

Stages, top to bottom (one module each): discover (meta, launcher side) ->
convert per episode [episode: parquet, decode: mp4 -> NV12, blocks: staging
file] -> plan shards of whole episodes (metadata only) -> write shards -> stats
(CombineFn) -> finalize (failed.jsonl, tables, then index.json last).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsList, AsSingleton

from loongforge.preprocess import files
from loongforge.preprocess.colorspace import ColorTarget
from loongforge.preprocess.config import PreprocessConfig, add_job_arguments, config_from_args
from loongforge.preprocess.convert import FAILED, STATS, ConvertEpisodeFn
from loongforge.preprocess.discover import EpisodeSpec, SourceMeta
from loongforge.preprocess.finalize import FinalizeFn
from loongforge.preprocess.report import summarize
from loongforge.preprocess.pack import METRICS_NS, STAGING_DIR, WriteShardFn, plan_shards
from loongforge.preprocess.prepare import prepare_job, resolve_params
from loongforge.preprocess.progress import ProgressMonitor
from loongforge.preprocess.stats import EpisodeMomentsFn
from loongforge.shared import paths
from loongforge.shared.errors import StorageError

log = logging.getLogger(__name__)
STAGED = "staged"


def beam_options(cfg: PreprocessConfig, beam_args: list[str]) -> PipelineOptions:
    """The local defaults unless the caller chose otherwise (any --runner, or
    its own --direct_* flags, wins: Dataflow/Flink options pass through)."""
    given = {a.split("=", 1)[0] for a in beam_args}
    flags = list(beam_args)
    if "--runner" not in given:
        # Beam's default DirectRunner would fetch a Prism binary (fails offline).
        flags.append("--runner=FnApiRunner")
        if "--direct_num_workers" not in given:
            flags.append(f"--direct_num_workers={cfg.num_workers}")
        if "--direct_running_mode" not in given:
            flags.append("--direct_running_mode=multi_processing")
    return PipelineOptions(flags=flags)


# What local worker processes log: warnings, plus this job's own progress lines
# (Beam's harness otherwise prints ~15 INFO lines of gRPC set-up per worker).
WORKER_LOG_LEVELS = {"default_sdk_harness_log_level": "WARNING",
                     "sdk_harness_log_level_overrides": {"loongforge": "INFO", "__main__": "ERROR"}}


def local_runner(options: PipelineOptions):
    """The FnApiRunner with worker log levels, when the job runs locally; None
    (Beam picks the runner from --runner) otherwise. FnApiRunner hands its
    workers only the options in its provision info, so they go there."""
    if options.get_all_options().get("runner") != "FnApiRunner":
        return None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from google.protobuf import struct_pb2

    worker_options = struct_pb2.Struct()
    worker_options.update(WORKER_LOG_LEVELS)
    info = beam_provision_api_pb2.ProvisionInfo(pipeline_options=worker_options)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(info))


def build_pipeline(p: beam.Pipeline, cfg: PreprocessConfig, meta: SourceMeta, episodes: list[EpisodeSpec],
                   color: ColorTarget | None = None):
    params = resolve_params(cfg, meta, color)
    # The Reshuffles are fusion breaks: without them a runner may fuse the heavy
    # per-episode (per-shard) work with the one-element Create (plan) and run it
    # all on one worker.
    converted = (
        p
        | "ListEpisodes" >> beam.Create(episodes)
        | "SpreadEpisodes" >> beam.Reshuffle()
        | "ConvertEpisodes" >> beam.ParDo(ConvertEpisodeFn(meta, params)).with_outputs(FAILED, STATS, main=STAGED)
    )
    staged, failed = converted[STAGED], converted[FAILED]
    stats = converted[STATS] | "EpisodeMoments" >> beam.CombineGlobally(EpisodeMomentsFn())  # merged in finalize
    written = (
        staged
        | "CollectStaged" >> beam.combiners.ToList()
        | "PlanShards" >> beam.FlatMap(plan_shards, cfg.shard_size)
        | "SpreadShards" >> beam.Reshuffle()
        | "WriteShards" >> beam.ParDo(WriteShardFn(cfg.output))
    )
    return (
        p
        | "Once" >> beam.Create([None])
        | "WriteIndex" >> beam.ParDo(FinalizeFn(meta, cfg, params), written=AsList(written), failed=AsList(failed),
                                     stats=AsSingleton(stats), staged=AsList(staged))
    )


def prepare_output(output: str) -> None:
    """Drop a previous run's index first: if this run dies half-way, the root
    must not look complete while its shards are being overwritten."""
    files.remove_file(paths.join(output, paths.INDEX_FILE))
    files.remove_tree(files.join(output, STAGING_DIR))


def run_job(cfg: PreprocessConfig, beam_args: list[str] | None = None) -> dict:
    """Run the job to completion; returns the summary (index numbers + timing)."""
    # Before any work (prepare.py): the dataset's version and episodes, the split checked against them,
    # cameras in different colours decided (--color-range/--color-matrix).
    job = prepare_job(cfg)
    cfg, meta, episodes, color = job.cfg, job.meta, job.episodes, job.color
    prepare_output(cfg.output)
    log.info("preprocess %s -> %s: %d episodes, cameras %s, colour %s/%s", cfg.input, cfg.output, len(episodes),
             [c.key for c in meta.cameras], color.matrix, color.range)
    t0 = time.perf_counter()
    options = beam_options(cfg, beam_args or [])
    runner = local_runner(options)
    monitor = ProgressMonitor(cfg.output, {e.index: e.length for e in episodes}, len(meta.cameras),
                              cfg.progress_s) if runner is not None and cfg.progress_s > 0 else None
    p = beam.Pipeline(runner=runner, options=options)
    build_pipeline(p, cfg, meta, episodes, color)
    try:
        with monitor if monitor is not None else contextlib.nullcontext():
            result = p.run()
            result.wait_until_finish()
    except Exception as exc:
        err = _output_error(cfg.output, exc)
        if err is None:
            raise
        raise err from exc
    summary = summarize(cfg.output, time.perf_counter() - t0)
    summary["input_episodes"] = len(episodes)
    summary["counters"] = job_counters(result)
    if monitor is not None:
        monitor.finish(summary["episodes"], summary["failed"], summary["source_frames"] * len(meta.cameras))
    return summary


def job_counters(result) -> dict[str, int]:
    """This job's Beam counters (METRICS_NS), summed over steps; {} where the
    runner does not report them."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NS))["counters"]
    except (AttributeError, NotImplementedError, KeyError):
        return {}
    out: dict[str, int] = {}
    for r in found:
        value = r.committed if r.committed is not None else r.attempted
        out[r.key.metric.name] = out.get(r.key.metric.name, 0) + int(value or 0)
    return dict(sorted(out.items()))


_DISK_FULL = ("[Errno 28]", "No space left on device", "[Errno 122]", "Disk quota exceeded")


def _output_error(output: str, exc: Exception) -> StorageError | None:
    """A full disk under the output, as one clear error instead of a worker traceback. Runners
    re-raise a worker's exception as a RuntimeError holding only its text (the type does not
    survive the process boundary), so the errno text is what there is to match."""
    text = str(exc)
    if not any(marker in text for marker in _DISK_FULL):
        return None
    last = text.strip().splitlines()[-1][:300]
    return StorageError(
        f"disk full writing under {output} ({last}). Nothing was published: index.json is written last and "
        "is absent, so readers and the cache refuse this root. Free space or choose another --output and re-run "
        "(the job is deterministic: same input, same shards)")


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m loongforge.preprocess.pipeline", description=__doc__.splitlines()[0])
    add_job_arguments(parser)
    args, beam_args = parser.parse_known_args(argv)
    cfg = config_from_args(args)
    summary = run_job(cfg, beam_args)
    summary["failed_allowed"] = cfg.failed_allowed(summary["input_episodes"])
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(sys.argv[1:])
    print(summary)
    from loongforge.preprocess.cli import EXIT_FAILED_RECORDS  # the same exit codes as `loongforge preprocess`

    sys.exit(EXIT_FAILED_RECORDS if summary["failed"] > summary["failed_allowed"] else 0)
