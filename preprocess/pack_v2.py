"""Format 2 (`--format-version 2`): plan shards of whole episodes, write them, publish.

The convert stage already wrote each episode's fragment (arrays + frame blocks,
shared/blocks.py) to its staging file and emitted only its layout. As in v1,
frame bytes never travel through a Beam shuffle: one global step plans shards
from the layouts (greedy, whole episodes, episode order), shard writers copy
staging files into place, and finalize writes failed.jsonl, the tables and
index.json LAST (shared/writer_v2.py), then removes the staging files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsList, AsSingleton

from loongforge import __version__
from loongforge.preprocess import files
from loongforge.preprocess.finalize import build_index, remove_stale_shards
from loongforge.preprocess.pack import METRICS_NS, STAGING_DIR, StagedEpisode
from loongforge.shared import paths, storage
from loongforge.shared.blocks import EpisodeLayout
from loongforge.shared.index_v2 import TABLE_DIR
from loongforge.shared.writer_v2 import plan_episode_shards, publish_v2, write_v2_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShardPlanV2:
    number: int
    items: tuple[tuple[str, EpisodeLayout], ...]  # (staging file, layout), in shard order


def plan_shards_v2(staged: Iterable[StagedEpisode], shard_size: int) -> list[ShardPlanV2]:
    by_episode = {ep.episode: ep for ep in staged}
    order = sorted(by_episode)
    groups = plan_episode_shards(((e, by_episode[e].layout.length) for e in order), shard_size)
    return [ShardPlanV2(number=i, items=tuple((by_episode[e].path, by_episode[e].layout) for e in group))
            for i, group in enumerate(groups)]


def _fragment(path: str) -> memoryview:
    return storage.map_file(path) if storage.is_local(path) else memoryview(storage.read_bytes(path))


class WriteShardV2Fn(beam.DoFn):
    """ShardPlanV2 -> (shard number, manifest entry, layouts placed in the shard)."""

    def __init__(self, output: str):
        self.output = output
        self.shards = Metrics.counter(METRICS_NS, "shards_written")
        self.bytes = Metrics.counter(METRICS_NS, "shard_bytes_written")

    def process(self, plan: ShardPlanV2):
        fragments = ((layout, _fragment(path)) for path, layout in plan.items)
        entry, placed = write_v2_shard(self.output, plan.number, fragments)
        self.shards.inc()
        self.bytes.inc(entry["bytes"])
        log.info("wrote %s: %d episodes, %.1f MB", entry["name"], len(placed), entry["bytes"] / 1e6)
        yield plan.number, entry, tuple(placed)


class FinalizeV2Fn(beam.DoFn):
    """Runs once, after every shard is written: failed.jsonl, tables, index.json last."""

    def __init__(self, meta, cfg, params):
        self.meta, self.cfg, self.params = meta, cfg, params

    def process(self, _unused, written, failed, stats, staged):
        # dataset info, split, stats and stale-shard cleanup as in v1
        base = build_index(self.meta, self.cfg, self.params, [], list(failed), stats or {}, list(staged))
        dataset = dataclasses.replace(base.dataset, frames_per_sample=1)
        written = sorted(written, key=lambda w: w[0])
        shards = [entry for _, entry, _ in written]
        layouts = [lay for _, _, placed in written for lay in placed]
        shard_of = [number for number, _, placed in written for _ in placed]
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in base.failed)
        storage.write_bytes_atomic(paths.join(self.cfg.output, paths.FAILED_FILE), lines.encode())
        params = {**base.params, "block_size": self.params.block_frames}
        publish_v2(self.cfg.output, dataset=dataset, params=params, shards=shards, layouts=layouts, shard_of=shard_of,
                   failed=base.failed, val_episodes=base.val_episodes,
                   created_by=f"loongforge.preprocess {__version__}")
        remove_stale_shards(self.cfg.output, {s["name"] for s in shards})
        files.remove_tree(files.join(self.cfg.output, STAGING_DIR))
        log.info("wrote %s (format 2): %d shards, %d episodes, %d frames, %d failed", self.cfg.output, len(shards),
                 len(layouts), sum(lay.num_frames for lay in layouts), len(base.failed))
        yield {"shards": len(shards), "episodes": len(layouts), "tables": TABLE_DIR}


def write_v2(p: beam.Pipeline, cfg, meta, params, staged, failed, stats):
    """The format-2 tail of the graph (build_pipeline's v1 tail, for whole episodes)."""
    written = (
        staged
        | "CollectStaged" >> beam.combiners.ToList()
        | "PlanShards" >> beam.FlatMap(plan_shards_v2, cfg.shard_size)
        | "SpreadShards" >> beam.Reshuffle()
        | "WriteShards" >> beam.ParDo(WriteShardV2Fn(cfg.output))
    )
    return (
        p
        | "Once" >> beam.Create([None])
        | "WriteIndex" >> beam.ParDo(FinalizeV2Fn(meta, cfg, params), written=AsList(written),
                                     failed=AsList(failed), stats=AsSingleton(stats), staged=AsList(staged))
    )
