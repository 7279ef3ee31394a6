"""Stage 5: stage each episode's packed samples, plan shards, write shards.

Scale design: frame bytes never travel through a Beam shuffle. The convert
stage writes an episode's packed sample fragments to one staging file
(`OUTPUT/_staging/episode_NNNNNN.bin`) and emits only their (key, frames,
offset, length). One global step plans shards from that metadata alone (a few
hundred bytes per sample), and shard writers copy byte ranges from the staging
files. The plan is deterministic (episode order, then frame order; greedy fill
up to `shard_size`), so equal inputs give byte-identical shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.metrics import Metrics

from loongforge.preprocess import files
from loongforge.shared import paths, storage
from loongforge.shared.format import END_OF_ARCHIVE, Sample, pack_sample
from loongforge.shared.blocks import EpisodeLayout
from loongforge.shared.index import ShardEntry
from loongforge.shared.writer import write_shard

log = logging.getLogger(__name__)
STAGING_DIR = "_staging"
METRICS_NS = "loongforge.preprocess"


@dataclass(frozen=True, slots=True)
class StagedSample:
    key: str
    frames: int
    offset: int  # in the staging file
    length: int


@dataclass(frozen=True, slots=True)
class StagedEpisode:
    episode: int
    path: str  # staging file
    samples: tuple[StagedSample, ...]
    source_frames: int  # rows of the episode (= frames per camera)
    source_bytes: int  # parquet + mp4 bytes read
    videos: tuple[tuple[str, int, int, str, str, str], ...]  # (camera key, src h, src w, codec, matrix, range)
    layout: EpisodeLayout | None = None  # format 2: the staged episode fragment's layout (samples is then ())


@dataclass(frozen=True, slots=True)
class ShardPlan:
    number: int
    name: str
    items: tuple[tuple[str, StagedSample], ...]  # (staging file, sample), in shard order


def staging_path(output: str, episode: int, suffix: str = ".bin") -> str:
    """`.bin`: the episode's packed samples; `.failed`: a marker that it failed
    (both count as finished for the local runner's progress line)."""
    return files.join(output, STAGING_DIR, f"episode_{episode:06d}{suffix}")


def stage_samples(path: str, samples: Iterable[Sample], zstd_level: int) -> tuple[StagedSample, ...]:
    """Pack samples one at a time into a staging file (atomic); return their ranges."""
    staged, pos = [], 0
    with storage.open_atomic(path) as f:
        for sample in samples:
            frag = pack_sample(sample, zstd_level=zstd_level)
            f.write(frag)
            staged.append(StagedSample(key=sample.key, frames=sample.num_frames, offset=pos, length=len(frag)))
            pos += len(frag)
    return tuple(staged)


def plan_shards(staged: Iterable[StagedEpisode], shard_size: int) -> list[ShardPlan]:
    """Greedy, size-bounded, deterministic: a shard takes samples in (episode,
    frame) order until the next one would push it past `shard_size` (a single
    sample larger than `shard_size` gets a shard of its own)."""
    plans: list[ShardPlan] = []
    current: list[tuple[str, StagedSample]] = []
    size = len(END_OF_ARCHIVE)

    def flush():
        nonlocal current, size
        if current:
            number = len(plans)
            plans.append(ShardPlan(number=number, name=paths.shard_name(number), items=tuple(current)))
        current, size = [], len(END_OF_ARCHIVE)

    for ep in sorted(staged, key=lambda e: e.episode):
        for sample in ep.samples:
            if current and size + sample.length > shard_size:
                flush()
            current.append((ep.path, sample))
            size += sample.length
    flush()
    return plans


def _read_ranges(path: str, samples: list[StagedSample]) -> dict[str, memoryview]:
    """One read (or mmap) per staging file per shard; zero-copy slices per sample."""
    start = min(s.offset for s in samples)
    end = max(s.offset + s.length for s in samples)
    if storage.is_local(path):
        view = storage.map_file(path)
        return {s.key: view[s.offset : s.offset + s.length] for s in samples}
    data = memoryview(storage.read_bytes(path, start, end - start))
    return {s.key: data[s.offset - start : s.offset - start + s.length] for s in samples}


def write_planned_shard(output: str, plan: ShardPlan) -> ShardEntry:
    by_file: dict[str, list[StagedSample]] = {}
    for path, sample in plan.items:
        by_file.setdefault(path, []).append(sample)
    views: dict[str, memoryview] = {}
    for path, samples in by_file.items():
        views.update(_read_ranges(path, samples))
    fragments = [(s.key, s.frames, views[s.key]) for _, s in plan.items]
    return write_shard(output, plan.name, fragments)


class WriteShardFn(beam.DoFn):
    """ShardPlan -> ShardEntry (the shard is written atomically, sha256 recorded)."""

    def __init__(self, output: str):
        self.output = output
        self.shards = Metrics.counter(METRICS_NS, "shards_written")
        self.bytes = Metrics.counter(METRICS_NS, "shard_bytes_written")

    def process(self, plan: ShardPlan):
        entry = write_planned_shard(self.output, plan)
        self.shards.inc()
        self.bytes.inc(entry.bytes)
        log.info("wrote %s: %d samples, %.1f MB", entry.name, entry.samples, entry.bytes / 1e6)
        yield entry
