"""Stage 6: collect the job's results, write `failed.jsonl`, the tables, then `index.json` (LAST), then clean up.

The index is the commit point of the job: readers treat a root without one as
unfinished, so it is written only after every shard it names is in place: the
one element finalize runs on (`JobResults`) is combined from every shard
writer's output, so no shard is still being written. It is a main input, not
side inputs: a runner may compute each side input on its own (Dask's does,
converting every episode once per side input). Everything in the index is
sorted and free of timestamps, so identical runs give identical bytes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import apache_beam as beam

from loongforge import __version__
from loongforge.preprocess import files
from loongforge.preprocess.stages.colorspace import ColorTarget
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.stages.convert import FAILED, STAGED, STATS, ConvertParams
from loongforge.preprocess.stages.discover import SourceMeta
from loongforge.preprocess.stages.images import image_color
from loongforge.preprocess.stages.pack import STAGING_DIR, StagedEpisode
from loongforge.preprocess.stages.stats import embodiment_record, norm_stats
from loongforge.shared import paths, storage
from loongforge.shared.index import TABLE_DIR, CameraInfo, DatasetInfo
from loongforge.shared.split import choose_val_episodes, parse_val_spec
from loongforge.shared.writer import publish

log = logging.getLogger(__name__)
WRITTEN = "written"  # (shard number, manifest entry, placed layouts): WriteShards' output


@dataclass(frozen=True, slots=True)
class JobResults:
    """Everything finalize needs, in a deterministic order whatever order the runner delivered it in."""

    staged: tuple[StagedEpisode, ...]  # by episode
    failed: tuple[dict, ...]  # by (episode, camera, reason)
    moments: dict  # episode -> {"state": Moments, "action": Moments}, by episode
    written: tuple[tuple, ...]  # by shard number


class JobResultsFn(beam.CombineFn):
    """(tag, value) pairs of every stage -> one JobResults. Metadata only (no frame bytes):
    a layout per episode and a manifest entry per shard."""

    def create_accumulator(self) -> dict:
        return {STAGED: [], FAILED: [], STATS: {}, WRITTEN: []}

    def add_input(self, acc: dict, element) -> dict:
        tag, value = element
        if tag == STATS:
            episode, moments = value
            acc[STATS][int(episode)] = moments
        else:
            acc[tag].append(value)
        return acc

    def merge_accumulators(self, accumulators) -> dict:
        merged = self.create_accumulator()
        for acc in accumulators:
            merged[STATS].update(acc[STATS])
            for tag in (STAGED, FAILED, WRITTEN):
                merged[tag].extend(acc[tag])
        return merged

    def extract_output(self, acc: dict) -> JobResults:
        return JobResults(
            staged=tuple(sorted(acc[STAGED], key=lambda e: e.episode)),
            failed=tuple(sorted(acc[FAILED], key=lambda r: (r["episode"], r.get("camera") or "", r["reason"]))),
            moments=dict(sorted(acc[STATS].items())),
            written=tuple(sorted(acc[WRITTEN], key=lambda w: w[0])))


def _cameras(meta: SourceMeta, params: ConvertParams, staged: list[StagedEpisode]) -> tuple[CameraInfo, ...]:
    """Camera infos from the decoded streams (first converted episode), falling
    back to info.json when nothing converted; a stored size of its own where a
    camera's differs from the dataset's (the first camera's)."""
    seen = {key: (h, w, codec) for key, h, w, codec, *_ in (staged[0].videos if staged else ())}
    cams = []
    for c, cam in enumerate(meta.cameras):
        h, w, codec = seen.get(cam.key, (cam.height, cam.width, cam.codec))
        own = params.size(c) if params.size(c) != (params.height, params.width) else (0, 0)
        cams.append(CameraInfo(key=cam.key, slot=cam.slot, source_height=h, source_width=w, codec=codec,
                               height=own[0], width=own[1]))
    return tuple(cams)


def held_out(cfg: PreprocessConfig, converted: list[int]) -> tuple[int, ...]:
    """The validation episodes: the ids the launcher resolved against the discovered episodes
    (prepare.py), less any that failed to convert."""
    parsed = parse_val_spec(cfg.val_episodes)
    if isinstance(parsed, tuple) and not cfg.val_count and not cfg.val_fraction:
        return tuple(e for e in parsed if e in set(converted))
    return choose_val_episodes(cfg.val_episodes, converted, count=cfg.val_count, fraction=cfg.val_fraction)


def _source_colors(staged: list[StagedEpisode]) -> dict:
    """camera key -> the matrices and ranges its source streams were in (what
    the NV12 was converted from, when the job converted)."""
    out: dict[str, dict[str, set]] = {}
    for ep in staged:
        for key, _, _, _, matrix, rng in ep.videos:
            seen = out.setdefault(key, {"matrix": set(), "range": set()})
            seen["matrix"].add(matrix)
            seen["range"].add(rng)
    return {key: {k: sorted(v) for k, v in seen.items()} for key, seen in sorted(out.items())}


def frame_timing(meta: SourceMeta, params: ConvertParams, staged: list[StagedEpisode]) -> dict:
    """What the timestamp rule did (stages/timing.py): its tolerance and mismatch policy, and per
    video camera the rows shifted, clamped and skipped over the converted episodes (an image feature
    holds one image per row: nothing to map)."""
    cameras = {c.key: {"shifted": 0, "clamped": 0, "skipped": 0} for c in meta.cameras if c.kind == "video"}
    for ep in staged:
        for key, *counts in ep.timing:
            for kind, count in zip(("shifted", "clamped", "skipped"), counts):
                cameras[key][kind] += int(count)
    return {"tolerance_s": params.timing.tolerance_s, "mismatch": params.timing.mismatch, "cameras": cameras}


def build_dataset(meta: SourceMeta, cfg: PreprocessConfig, params: ConvertParams, moments: dict,
                  staged: list[StagedEpisode]) -> tuple[DatasetInfo, tuple[int, ...]]:
    """(dataset info, validation episodes). `moments`: the per-episode partials (JobResults);
    the stats use the training episodes only."""
    staged = sorted(staged, key=lambda e: e.episode)
    val_episodes = held_out(cfg, [e.episode for e in staged])
    stats = norm_stats(moments, exclude=val_episodes)
    if moments and not stats:
        log.warning("val_episodes %s hold every converted episode: normalisation stats fall back to all of "
                    "them, and nothing is left to train on", list(val_episodes))
        stats = norm_stats(moments)
    record = {}
    if params.embodiment is not None and moments:
        used = {int(e) for e in (val_episodes if len(set(val_episodes) & set(moments)) < len(moments) else ())}
        record = embodiment_record(params.embodiment, [moments[e] for e in sorted(moments)
                                                       if int(e) not in used and "features" in moments[e]])
    cameras = _cameras(meta, params, staged)
    color = params.color or (ColorTarget(*staged[0].videos[0][4:6]) if staged and staged[0].videos else ColorTarget())
    state_dim = meta.state_dim or len(stats.get("state", {}).get("mean", ()))
    action_dim = meta.action_dim or len(stats.get("action", {}).get("mean", ()))
    source = {
        "uri": meta.uri, "codebase_version": meta.codebase_version, "robot_type": meta.robot_type,
        "fingerprint": meta.fingerprint, "fingerprint_mode": cfg.fingerprint, "warnings": list(meta.warnings),
        "color": _source_colors(staged),
        "bytes": sum(e.source_bytes for e in staged) + (meta.shared_bytes if staged else 0),
        "frames": sum(e.source_frames for e in staged),
        # What LeRobot-compatible readers (train/data/lerobot.py) need: LeRobot's own statistics
        # (over every source episode, as LeRobotDataset loads them) and info.json's features.
        "lerobot_stats": meta.stats, "features": meta.features,
        # The columns of LeRobot's item and the episode arrays holding them; which frame each row shows.
        "columns": {c.name: c.to_json() for c in meta.columns},
        "frame_timing": frame_timing(meta, params, staged),
        "image_color": image_color(staged),  # what 4:2:0 chroma cost each image-feature camera
    }
    # frames_per_sample 1: every frame is stored once; samples are shaped at training time (delta indices).
    dataset = DatasetInfo(
        fps=meta.fps, height=params.height, width=params.width, cameras=cameras, color_matrix=color.matrix,
        color_range=color.range, state_dim=state_dim, action_dim=action_dim, action_horizon=cfg.action_horizon,
        frames_per_sample=1, state_names=meta.state_names, action_names=meta.action_names,
        modality=meta.modality, stats=stats, source=source, embodiment=record,
        tasks={str(k): v for k, v in sorted(meta.tasks.items())})
    return dataset, val_episodes


def remove_stale_shards(output: str, keep: set[str]) -> None:
    """A previous run with more shards leaves higher-numbered files behind."""
    try:
        listed = files.list_files(output, paths.SHARD_DIR)
    except FileNotFoundError:
        return
    for name in sorted(listed - keep):
        if name.endswith(".tar"):
            files.remove_file(files.join(output, name))


class FinalizeFn(beam.DoFn):
    """JobResults -> failed.jsonl, tables, index.json last; runs once, after every shard is written."""

    def __init__(self, meta: SourceMeta, cfg: PreprocessConfig, params: ConvertParams):
        self.meta, self.cfg, self.params = meta, cfg, params

    def process(self, results: JobResults):
        dataset, val_episodes = build_dataset(self.meta, self.cfg, self.params, results.moments,
                                              list(results.staged))
        written, failed = results.written, list(results.failed)
        shards = [entry for _, entry, _ in written]
        layouts = [lay for _, _, placed in written for lay in placed]
        shard_of = [number for number, _, placed in written for _ in placed]
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in failed)
        storage.write_bytes_atomic(paths.join(self.cfg.output, paths.FAILED_FILE), lines.encode())
        params = {**self.cfg.output_params(), "height": self.params.height, "width": self.params.width,
                  "block_size": self.params.block_frames}
        publish(self.cfg.output, dataset=dataset, params=params, shards=shards, layouts=layouts, shard_of=shard_of,
                failed=failed, val_episodes=val_episodes, created_by=f"loongforge.preprocess {__version__}")
        remove_stale_shards(self.cfg.output, {s["name"] for s in shards})
        files.remove_tree(files.join(self.cfg.output, STAGING_DIR))
        log.debug("wrote %s: %d shards, %d episodes, %d frames, %d failed", self.cfg.output, len(shards),
                 len(layouts), sum(lay.num_frames for lay in layouts), len(failed))
        yield {"shards": len(shards), "episodes": len(layouts), "tables": TABLE_DIR}
