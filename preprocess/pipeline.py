"""The preprocess job: LeRobot dataset (v2.0/v2.1/v3.0: parquet + mp4 or images) -> NV12 shards + index (FORMAT.md).

Local (default runner: Beam's FnApiRunner, one worker process per core):

    loongforge preprocess --input data/sample --output out/shards
    python -m loongforge.preprocess.pipeline --input data/sample --output out/shards --workers 2

Dataflow (standard Beam pipeline options pass straight through; see
infra/dataflow/launch.sh for the full command):

    python -m loongforge.preprocess.pipeline --input gs://bkt/lerobot/ds --output gs://bkt/shards/ds \\
        --runner=DataflowRunner --project=P --region=us-central1 --temp_location=gs://bkt/tmp \\
        --setup_file=$PWD/pyproject.toml --requirements_file=infra/dataflow/requirements.txt

A dask.distributed cluster (Beam's Dask runner; infra/dask/; runner/choice.py lists every runner):

    loongforge preprocess --input D --output S --runner dask --dask-scheduler tcp://HOST:8786

Stages, top to bottom (one module each): discover (meta, launcher side) ->
convert per episode [episode: parquet, decode: mp4 -> NV12, blocks: staging
file; stats: moments] -> pack: plan shards of whole episodes (metadata only),
group each shard's episodes, write shards -> finalize (collect the results;
failed.jsonl, tables, then index.json last).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import apache_beam as beam

from loongforge.preprocess import files
from loongforge.preprocess.stages.colorspace import ColorTarget
from loongforge.preprocess.config import EXIT_FAILED_RECORDS, PreprocessConfig, add_job_arguments, config_from_args
from loongforge.preprocess.stages.convert import STAGED, ConvertEpisodeFn, select_tag, tagged
from loongforge.preprocess.stages.discover import EpisodeSpec, SourceMeta
from loongforge.preprocess.stages.finalize import WRITTEN, FinalizeFn, JobResultsFn
from loongforge.preprocess.runner.launch import Launch
from loongforge.preprocess.stages.pack import STAGING_DIR, WriteShards
from loongforge.preprocess.prepare import prepare_job, resolve_embodiment, resolve_params
from loongforge.shared.summary import summarize
from loongforge.preprocess.runner.choice import RunnerConfig, add_runner_arguments, runner_from_args
from loongforge.shared import paths
from loongforge.shared.errors import StorageError

log = logging.getLogger(__name__)


def build_pipeline(p: beam.Pipeline, cfg: PreprocessConfig, meta: SourceMeta, episodes: list[EpisodeSpec],
                   color: ColorTarget | None = None, progress_topic: str = "", embodiment=None):
    """The job's graph, for any runner: no tagged outputs (a stage emits (tag, value) pairs that
    a filter splits), no side inputs (finalize's one input is combined from every stage's output),
    no default for a global combine (an empty one has nothing to say). On the Dask runner only
    the last step's inputs run: every step here leads to WriteIndex."""
    params = resolve_params(cfg, meta, color, embodiment or resolve_embodiment(cfg, meta))
    converted = (
        p
        | "ListEpisodes" >> beam.Create(episodes)
        # A fusion break: without it a runner may fuse the per-episode work with the Create
        # and run it on one worker (the Dask runner ignores it: runner/choice.py sets its partitions).
        | "SpreadEpisodes" >> beam.Reshuffle()
        | "ConvertEpisodes" >> beam.ParDo(ConvertEpisodeFn(meta, params, progress_topic))
    )
    written = (
        converted
        | "Staged" >> beam.FlatMap(select_tag, STAGED)
        | "WriteShards" >> WriteShards(cfg.output, cfg.shard_size)
        | "TagWritten" >> beam.Map(tagged, WRITTEN)
    )
    return (
        (converted, written)
        | "AllResults" >> beam.Flatten()
        | "CollectResults" >> beam.CombineGlobally(JobResultsFn()).without_defaults()
        | "WriteIndex" >> beam.ParDo(FinalizeFn(meta, cfg, params))
    )


def prepare_output(output: str) -> None:
    """Drop a previous run's index first: if this run dies half-way, the root
    must not look complete while its shards are being overwritten."""
    files.remove_file(paths.join(output, paths.INDEX_FILE))
    files.remove_tree(files.join(output, STAGING_DIR))


def run_job(cfg: PreprocessConfig, beam_args: list[str] | None = None, runner: RunnerConfig | None = None) -> dict:
    """Run the job to completion; returns the summary (index numbers + timing)."""
    # Before any work (prepare.py): the dataset's version and episodes, the split checked against them,
    # cameras in different colours decided (--color-range/--color-matrix).
    job = prepare_job(cfg)
    cfg, meta, episodes, color = job.cfg, job.meta, job.episodes, job.color
    lengths = {e.index: e.length for e in episodes}
    # The runner next: a cluster that cannot run the job fails before the output root is touched.
    with Launch(cfg, runner or RunnerConfig(), beam_args or [], lengths, len(meta.cameras)) as launch:
        prepare_output(cfg.output)
        log.info("preprocess %s -> %s: %d episodes, cameras %s, colour %s/%s", cfg.input, cfg.output, len(episodes),
                 [c.key for c in meta.cameras], color.matrix, color.range)
        t0 = time.perf_counter()
        p = beam.Pipeline(runner=launch.beam_runner, options=launch.options)
        build_pipeline(p, cfg, meta, episodes, color, launch.progress_topic, job.embodiment)
        try:
            launch.run(p)
        except Exception as exc:
            err = _output_error(cfg.output, exc)
            if err is None:
                raise
            raise err from exc
        summary = summarize(cfg.output, time.perf_counter() - t0)
        summary["input_episodes"] = len(episodes)
        summary.update(launch.report(summary))
    return summary


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
    add_runner_arguments(parser)
    args, beam_args = parser.parse_known_args(argv)
    cfg = config_from_args(args)
    runner, beam_args = runner_from_args(args, beam_args)
    summary = run_job(cfg, beam_args, runner)
    summary["failed_allowed"] = cfg.failed_allowed(summary["input_episodes"])
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(sys.argv[1:])
    print(summary)
    sys.exit(EXIT_FAILED_RECORDS if summary["failed"] > summary["failed_allowed"] else 0)
