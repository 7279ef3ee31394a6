"""Stage 6: write `failed.jsonl`, then `index.json` (LAST), then clean up.

The index is the commit point of the job: readers treat a root without one as
unfinished, so it is written only after every shard it names is in place
(Beam side inputs guarantee all shard writers finished). Everything in it is
sorted and free of timestamps, so identical runs give identical bytes.
"""

from __future__ import annotations

import json
import logging

import apache_beam as beam

from loongforge import __version__
from loongforge.preprocess import files
from loongforge.preprocess.colorspace import ColorTarget
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.convert import ConvertParams
from loongforge.preprocess.discover import SourceMeta
from loongforge.preprocess.pack import STAGING_DIR, StagedEpisode
from loongforge.preprocess.stats import norm_stats
from loongforge.shared import paths, storage
from loongforge.shared.index import CameraInfo, DatasetInfo, ShardEntry, ShardIndex, save_index
from loongforge.shared.split import choose_val_episodes

log = logging.getLogger(__name__)


def _cameras(meta: SourceMeta, staged: list[StagedEpisode]) -> tuple[CameraInfo, ...]:
    """Camera infos from the decoded streams (first converted episode), falling
    back to info.json when nothing converted."""
    seen = {key: (h, w, codec) for key, h, w, codec, *_ in (staged[0].videos if staged else ())}
    cams = []
    for cam in meta.cameras:
        h, w, codec = seen.get(cam.key, (cam.height, cam.width, cam.codec))
        cams.append(CameraInfo(key=cam.key, slot=cam.slot, source_height=h, source_width=w, codec=codec))
    return tuple(cams)


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


def build_index(meta: SourceMeta, cfg: PreprocessConfig, params: ConvertParams, entries: list[ShardEntry],
                failed: list[dict], moments: dict, staged: list[StagedEpisode]) -> ShardIndex:
    """`moments`: EpisodeMomentsFn's per-episode partials; the stats use the training episodes only."""
    staged = sorted(staged, key=lambda e: e.episode)
    val_episodes = choose_val_episodes(cfg.val_episodes, [e.episode for e in staged])
    stats = norm_stats(moments, exclude=val_episodes)
    if moments and not stats:
        log.warning("val_episodes %s hold every converted episode: normalisation stats fall back to all of "
                    "them, and nothing is left to train on", list(val_episodes))
        stats = norm_stats(moments)
    cameras = _cameras(meta, staged)
    color = params.color or (ColorTarget(*staged[0].videos[0][4:6]) if staged and staged[0].videos else ColorTarget())
    state_dim = meta.state_dim or len(stats.get("state", {}).get("mean", ()))
    action_dim = meta.action_dim or len(stats.get("action", {}).get("mean", ()))
    source = {
        "uri": meta.uri, "codebase_version": meta.codebase_version, "robot_type": meta.robot_type,
        "fingerprint": meta.fingerprint, "fingerprint_mode": cfg.fingerprint, "warnings": list(meta.warnings),
        "color": _source_colors(staged),
        "bytes": sum(e.source_bytes for e in staged), "frames": sum(e.source_frames for e in staged),
    }
    dataset = DatasetInfo(
        fps=meta.fps, height=params.height, width=params.width, cameras=cameras, color_matrix=color.matrix,
        color_range=color.range, state_dim=state_dim, action_dim=action_dim, action_horizon=cfg.action_horizon,
        frames_per_sample=cfg.frames_per_sample, state_names=meta.state_names, action_names=meta.action_names,
        modality=meta.modality, stats=stats, source=source,
        tasks={str(k): v for k, v in sorted(meta.tasks.items())})
    failed_sorted = tuple(sorted(failed, key=lambda r: (r["episode"], r.get("camera") or "", r["reason"])))
    return ShardIndex(dataset=dataset, shards=tuple(sorted(entries, key=lambda e: e.name)),
                      params={**cfg.output_params(), "height": params.height, "width": params.width},
                      failed=failed_sorted, episodes=len(staged),
                      val_episodes=val_episodes,
                      created_by=f"loongforge.preprocess {__version__}")


def remove_stale_shards(output: str, keep: set[str]) -> None:
    """A previous run with more shards leaves higher-numbered files behind (v1 and v2 finalize)."""
    try:
        listed = files.list_files(output, paths.SHARD_DIR)
    except FileNotFoundError:
        return
    for name in sorted(listed - keep):
        if name.endswith(".tar"):
            files.remove_file(files.join(output, name))


def write_outputs(index: ShardIndex, output: str) -> str:
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in index.failed)
    storage.write_bytes_atomic(paths.join(output, paths.FAILED_FILE), lines.encode())
    path = save_index(index, output)  # last: its presence means the shard set is complete
    remove_stale_shards(output, {s.name for s in index.shards})
    files.remove_tree(files.join(output, STAGING_DIR))
    return path


class FinalizeFn(beam.DoFn):
    """Runs once, after every shard is written; emits the index summary."""

    def __init__(self, meta: SourceMeta, cfg: PreprocessConfig, params: ConvertParams):
        self.meta, self.cfg, self.params = meta, cfg, params

    def process(self, _unused, entries, failed, stats, staged):
        index = build_index(self.meta, self.cfg, self.params, list(entries), list(failed), stats or {},
                            list(staged))
        path = write_outputs(index, self.cfg.output)
        log.info("wrote %s: %d shards, %d samples, %d failed", path, len(index.shards), index.num_samples,
                 len(index.failed))
        yield index.summary()
