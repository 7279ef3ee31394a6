"""Stage 5: stage each episode's fragment, plan shards of whole episodes, write them.

Scale design: frame bytes never travel through a Beam shuffle. The convert
stage writes an episode's fragment (its arrays and frame blocks, shared/blocks.py)
to one staging file (`OUTPUT/_staging/episode_NNNNNN.bin`) and emits only its
layout. One global step plans shards from the episode sizes alone (greedy, whole
episodes, episode order); each episode is then joined with its place in the plan and
grouped by shard number, so the shard writers (copying staging files into place) are
spread over the workers like any keyed step. The plan is deterministic, so equal
inputs give byte-identical shards.
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
    # Per camera (key, rows shifted, clamped, skipped) by the timestamp rule (stages/timing.py).
    timing: tuple[tuple[str, int, int, int], ...] = ()
    # Per image-feature camera (key, largest |diff| /255, sum of |diff|, values): the colour its NV12 lost.
    image_loss: tuple[tuple[str, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ShardPlan:
    number: int
    items: tuple[tuple[str, EpisodeLayout], ...]  # (staging file, layout), in shard order


def staging_path(output: str, episode: int, suffix: str = ".bin") -> str:
    """`.bin`: the episode's fragment; `.failed`: a marker that it failed
    (both count as finished for the local runner's progress line)."""
    return files.join(output, STAGING_DIR, f"episode_{episode:06d}{suffix}")


def place_episodes(sizes: Iterable[tuple[int, int]], shard_size: int):
    """(episode, fragment bytes) of every staged episode -> (episode, (shard number, position)).
    Greedy, size-bounded, deterministic: a shard takes whole episodes in episode order
    until the next one would push it past `shard_size` (a larger one gets its own shard)."""
    groups = plan_episode_shards(sorted(sizes), shard_size)
    for number, group in enumerate(groups):
        for position, episode in enumerate(group):
            yield episode, (number, position)


def _episode_size(staged: StagedEpisode) -> tuple[int, int]:
    return staged.episode, staged.layout.length


def _key_by_episode(staged: StagedEpisode) -> tuple[int, StagedEpisode]:
    return staged.episode, staged


def _key_by_shard(joined) -> tuple[int, tuple[int, str, EpisodeLayout]]:
    """(episode, {"staged": [StagedEpisode], "place": [(shard, position)]}) -> (shard, (position, path, layout))."""
    episode, found = joined
    staged, place = list(found["staged"]), list(found["place"])
    if len(staged) != 1 or len(place) != 1:
        raise RuntimeError(f"episode {episode}: {len(staged)} staged fragments and {len(place)} shard places; "
                           "expected one of each")
    (number, position), ep = place[0], staged[0]
    return number, (position, ep.path, ep.layout)


def _shard_plan(number: int, items) -> ShardPlan:
    return ShardPlan(number=number, items=tuple((path, layout) for _, path, layout in sorted(items)))


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
        log.debug("wrote %s: %d episodes, %.1f MB", entry["name"], len(placed), entry["bytes"] / 1e6)
        yield plan.number, entry, tuple(placed)


class WriteShards(beam.PTransform):
    """StagedEpisode -> (shard number, manifest entry, layouts placed in the shard), one group per shard.

    The writes are not fanned out from the one-element plan step: a runner may keep that step's
    output in one partition (Dask's does, and ignores Reshuffle), which would write every shard in
    one task on one worker. A key (the shard number) is what every runner spreads over workers."""

    def __init__(self, output: str, shard_size: int):
        super().__init__()
        self.output, self.shard_size = output, shard_size

    def expand(self, staged):
        places = (
            staged
            | "EpisodeSizes" >> beam.Map(_episode_size)
            # no default: without a staged episode there is no plan, and no shard to write
            | "CollectSizes" >> beam.CombineGlobally(beam.combiners.ToListCombineFn()).without_defaults()
            | "PlanShards" >> beam.FlatMap(place_episodes, self.shard_size)
        )
        return (
            {"staged": staged | "KeyByEpisode" >> beam.Map(_key_by_episode), "place": places}
            | "JoinPlan" >> beam.CoGroupByKey()
            | "KeyByShard" >> beam.Map(_key_by_shard)
            | "GroupShards" >> beam.GroupByKey()
            | "ShardPlans" >> beam.MapTuple(_shard_plan)
            | "WriteShard" >> beam.ParDo(WriteShardFn(self.output))
        )
