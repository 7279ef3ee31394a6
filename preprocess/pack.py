"""Stage 5: stage each episode's fragment, plan shards of whole episodes, write them.

Scale design: frame bytes never travel through a Beam shuffle. The convert
stage writes an episode's fragment (its arrays and frame blocks, shared/blocks.py)
to one staging file (`OUTPUT/_staging/episode_NNNNNN.bin`) and emits only its
layout. One global step plans shards from the layouts alone (greedy, whole
episodes, episode order), and shard writers copy staging files into place. The
plan is deterministic, so equal inputs give byte-identical shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.metrics import Metrics

from loongforge.preprocess import files
from loongforge.shared import storage
from loongforge.shared.blocks import EpisodeLayout
from loongforge.shared.writer import plan_episode_shards, write_shard

log = logging.getLogger(__name__)
STAGING_DIR = "_staging"
METRICS_NS = "loongforge.preprocess"


@dataclass(frozen=True, slots=True)
class StagedEpisode:
    episode: int
    path: str  # staging file
    layout: EpisodeLayout  # the staged fragment's layout (offsets relative to the file start)
    source_frames: int  # rows of the episode (= frames per camera)
    source_bytes: int  # parquet + mp4 bytes read
    videos: tuple[tuple[str, int, int, str, str, str], ...]  # (camera key, src h, src w, codec, matrix, range)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    number: int
    items: tuple[tuple[str, EpisodeLayout], ...]  # (staging file, layout), in shard order


def staging_path(output: str, episode: int, suffix: str = ".bin") -> str:
    """`.bin`: the episode's fragment; `.failed`: a marker that it failed
    (both count as finished for the local runner's progress line)."""
    return files.join(output, STAGING_DIR, f"episode_{episode:06d}{suffix}")


def plan_shards(staged: Iterable[StagedEpisode], shard_size: int) -> list[ShardPlan]:
    """Greedy, size-bounded, deterministic: a shard takes whole episodes in episode order
    until the next one would push it past `shard_size` (a larger one gets its own shard)."""
    by_episode = {ep.episode: ep for ep in staged}
    order = sorted(by_episode)
    groups = plan_episode_shards(((e, by_episode[e].layout.length) for e in order), shard_size)
    return [ShardPlan(number=i, items=tuple((by_episode[e].path, by_episode[e].layout) for e in group))
            for i, group in enumerate(groups)]


def _fragment(path: str) -> memoryview:
    return storage.map_file(path) if storage.is_local(path) else memoryview(storage.read_bytes(path))


class WriteShardFn(beam.DoFn):
    """ShardPlan -> (shard number, manifest entry, layouts placed in the shard)."""

    def __init__(self, output: str):
        self.output = output
        self.shards = Metrics.counter(METRICS_NS, "shards_written")
        self.bytes = Metrics.counter(METRICS_NS, "shard_bytes_written")

    def process(self, plan: ShardPlan):
        fragments = ((layout, _fragment(path)) for path, layout in plan.items)
        entry, placed = write_shard(self.output, plan.number, fragments)
        self.shards.inc()
        self.bytes.inc(entry["bytes"])
        log.info("wrote %s: %d episodes, %.1f MB", entry["name"], len(placed), entry["bytes"] / 1e6)
        yield plan.number, entry, tuple(placed)
