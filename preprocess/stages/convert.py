"""The per-episode transform: parquet + every camera's mp4 (or images) -> a staged episode fragment.

`ConvertEpisodeFn` chains stages 2-5 for one episode (read the parquet, decode
each camera once: its mp4 or its span of a shared mp4, or the image bytes of the
parquet; encode its arrays and frame blocks into a staging file) and
emits only metadata. Bad input never kills the job: a missing/corrupt video, an unreadable
parquet or a parquet/video length mismatch becomes a `failed` record (episode, camera,
reason) plus a counter, and the other episodes go on.

Its outputs are `(tag, value)` pairs on the one main output, not Beam's tagged outputs:
some runners (Dask's) do not split a ParDo's tagged outputs, and a pair is split by a
plain filter (`select_tag`) on every runner.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from loongforge.preprocess import files
from loongforge.preprocess.stages.colorspace import ColorTarget
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.stages.discover import EpisodeSpec, SourceMeta
from loongforge.preprocess.stages.episode import EpisodeTable, read_episode
from loongforge.preprocess.stages.images import images_to_nv12
from loongforge.preprocess.stages.pack import METRICS_NS, StagedEpisode, staging_path
from loongforge.preprocess.runner.progress import report_episode
from loongforge.preprocess.stages.stats import EmbodimentSpec, episode_moments
from loongforge.preprocess.stages.timing import FrameTiming
from loongforge.shared import storage
from loongforge.shared.blocks import encode_episode
from loongforge.shared.errors import FormatError, SourceDataError

log = logging.getLogger(__name__)
STAGED = "staged"  # StagedEpisode
FAILED = "failed"  # failure record (dict)
STATS = "stats"  # (episode, {"state": Moments, "action": Moments})


def tagged(value, tag: str) -> tuple:
    return tag, value


def select_tag(pair: tuple, tag: str):
    """`(tag, value)` -> value where the tag matches (a FlatMap): how a stage picks one kind of output."""
    if pair[0] == tag:
        yield pair[1]


@dataclass(frozen=True, slots=True)
class ConvertParams:
    """What the per-episode transform needs from PreprocessConfig, resolved
    (target size filled in from the source when the config leaves it open)."""

    output: str
    height: int  # the dataset's (the first camera's) stored size
    width: int
    resize_mode: str
    zstd_level: int
    slots: tuple[str, ...]  # camera slots in dataset order (block order in the shard)
    color: ColorTarget | None = None  # the dataset's colour (launcher probe); None: each stream keeps its own
    block_frames: int = 16  # frames per zstd block
    block_codec: str = "zstd"  # FORMAT.md "Block codec"
    sizes: tuple[tuple[int, int], ...] = ()  # per slot, its stored (height, width); () = all height x width
    timing: FrameTiming = FrameTiming()  # which frame a row shows (stages/timing.py)
    embodiment: EmbodimentSpec | None = None  # the run's N1.6 embodiment: its statistics are taken per episode

    def size(self, camera: int) -> tuple[int, int]:
        return self.sizes[camera] if self.sizes else (self.height, self.width)


def failure(episode: int, camera: str | None, reason: str, root: str = "") -> dict:
    if root:
        reason = reason.replace(root.rstrip("/") + "/", "")  # dataset-relative paths in records
    return {"episode": int(episode), "camera": camera, "reason": reason}


class ConvertEpisodeFn(beam.DoFn):
    """EpisodeSpec -> (STAGED, StagedEpisode) and (STATS, moments), or (FAILED, record).
    `progress_topic`: where each attempt reports on a dask worker (progress.report_episode); "" = nowhere."""

    def __init__(self, meta: SourceMeta, params: ConvertParams, progress_topic: str = ""):
        self.meta = meta
        self.params = params
        self.progress_topic = progress_topic
        self.converted = Metrics.counter(METRICS_NS, "episodes_converted")
        self.failed = Metrics.counter(METRICS_NS, "episodes_failed")
        self.samples = Metrics.counter(METRICS_NS, "samples")
        self.frames = Metrics.counter(METRICS_NS, "frames_decoded")
        self.rows = {kind: Metrics.counter(METRICS_NS, f"rows_{kind}") for kind in ("shifted", "clamped", "skipped")}

    def _fail(self, spec: EpisodeSpec, camera: str | None, exc: Exception):
        self.failed.inc()
        record = failure(spec.index, camera, str(exc), self.meta.uri)
        log.warning("episode %d failed: %s", spec.index, record["reason"])
        try:  # best effort: only the local progress line reads it
            storage.write_bytes_atomic(staging_path(self.params.output, spec.index, ".failed"),
                                       json.dumps(record).encode())
        except OSError as err:
            log.warning("episode %d: could not write its failure marker (%s); the failure is still counted and "
                        "in the failed-records output, only the local progress line misses it", spec.index, err)
        report_episode(self.progress_topic, spec.index, ok=False)
        return FAILED, record

    def _read_inputs(self, spec: EpisodeSpec):
        """(table, {slot: NV12}, camera infos, source bytes, per camera (key, shifted, clamped, skipped));
        raises _Failed naming the camera at fault (None = the parquet)."""
        camera = None
        try:
            table = read_episode(spec, self.meta)
            if spec.length >= 0 and spec.length != table.length:
                log.warning("episode %d: the episode metadata says %d frames, parquet has %d; trusting the parquet",
                            spec.index, spec.length, table.length)
            frames, videos, timing, losses = {}, [], [], []
            source_bytes = 0 if spec.shared_parquet else files.size(spec.parquet)
            keep = np.ones(table.length, bool)
            paths_of, spans = dict(spec.videos), dict(zip((k for k, _ in spec.videos), spec.spans))
            for c, cam in enumerate(self.meta.cameras):
                camera = cam.key
                frames[cam.slot], info, size, rows, loss = self._camera(c, cam, table, paths_of.get(cam.key),
                                                                        spans.get(cam.key), spec)
                source_bytes += size
                videos.append(info)
                if loss is not None:
                    losses.append((cam.key, *loss))
                if rows is not None:
                    timing.append((cam.key, *rows.counts()))
                if rows is not None and rows.skipped:
                    keep &= rows.frame >= 0
            camera = None
            if not keep.all():
                if not keep.any():
                    raise SourceDataError(f"episode {spec.index}: every row was skipped (--frame-mismatch skip): no "
                                          "row's timestamp has a frame within the tolerance")
                table = table.select(keep)
                frames = {slot: f[keep] for slot, f in frames.items()}
        except (SourceDataError, FormatError) as exc:
            raise _Failed(camera, exc) from exc
        except Exception as exc:  # noqa: BLE001 - a reader/decoder bug on one input must not kill the job
            log.exception("episode %d: unexpected error reading %s", spec.index, camera or "the parquet")
            raise _Failed(camera, SourceDataError(f"{type(exc).__name__}: {exc}")) from exc
        return table, frames, videos, source_bytes, tuple(timing), tuple(losses)

    def _camera(self, c: int, cam, table: EpisodeTable, path: str | None, span, spec: EpisodeSpec):
        """(NV12 frames, (key, source h, w, codec, matrix, range), source bytes, RowFrames or None for
        image features, one image per row, and for image features the colour lost to 4:2:0 chroma
        (images.images_to_nv12), else None) of one camera. Files shared by several episodes count 0
        here: their bytes are SourceMeta.shared_bytes."""
        p = self.params
        height, width = p.size(c)
        if cam.kind == "image":
            target = p.color or ColorTarget()
            out = np.empty((table.length, height * 3 // 2, width), np.uint8)
            sh, sw, fmt, loss = images_to_nv12(table.images[cam.key], out, resize_mode=p.resize_mode, target=target,
                                               origin=f"{spec.parquet} {cam.key}")
            return out, (cam.key, sh, sw, fmt, target.matrix, target.range), 0, None, loss
        if path is None:
            raise SourceDataError(f"episode {spec.index}: no video file for {cam.key}")
        out, info = decode_nv12(path, table.timestamps, height=height, width=width, resize_mode=p.resize_mode,
                                color=p.color, span=span, timing=p.timing)
        size = files.size(path) if span is None else 0
        return out, (cam.key, info.height, info.width, info.codec, info.color_matrix, info.color_range), size, \
            info.rows, None

    def process(self, spec: EpisodeSpec):
        t0 = time.perf_counter()
        p = self.params
        try:
            table, frames, videos, source_bytes, timing, losses = self._read_inputs(spec)
        except _Failed as failed:
            yield self._fail(spec, failed.camera, failed.error)
            return
        path = staging_path(p.output, spec.index)
        # Output errors (disk full, permissions) are not bad input: they propagate
        # and fail the job loudly instead of marking every episode failed.
        with storage.open_atomic(path) as f:
            layout = encode_episode(f, spec.index, frames, episode_arrays(table), slots=list(p.slots),
                                    block_size=p.block_frames, zstd_level=p.zstd_level, codec=p.block_codec)
        self.converted.inc()
        self.samples.inc(table.length)
        self.frames.inc(table.length * len(frames))
        for _, *counts in timing:
            for kind, count in zip(("shifted", "clamped", "skipped"), counts):
                if count:
                    self.rows[kind].inc(count)
        log.debug("episode %d: %d frames x %d cameras -> %d blocks of %d (%.2f s)", spec.index, table.length,
                 len(frames), sum(len(c) for c in layout.blocks), p.block_frames, time.perf_counter() - t0)
        report_episode(self.progress_topic, spec.index, ok=True)
        yield STATS, episode_moments(spec.index, table.state, table.action, episode_arrays(table), p.embodiment)
        yield STAGED, StagedEpisode(episode=spec.index, path=path, layout=layout, source_frames=table.length,
                                    source_bytes=source_bytes, videos=tuple(videos), timing=timing,
                                    image_loss=losses)


def episode_arrays(table) -> dict:
    """The per-frame arrays an episode stores (FORMAT.md), with the source's `index` when it has one
    and the other columns of LeRobot's item (`col_*`)."""
    out = {"state": table.state, "action": table.action, "timestamp": table.timestamps,
           "frame_index": table.frame_index, "task_index": table.task_index}
    if table.index is not None:
        out["index"] = table.index
    out.update(getattr(table, "columns", None) or {})
    return out


class _Failed(Exception):
    def __init__(self, camera: str | None, error: Exception):
        super().__init__(str(error))
        self.camera, self.error = camera, error
