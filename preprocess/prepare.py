"""Launcher-side checks and choices, before any work: the dataset's metadata and episodes
(discover), the validation split against the episodes found, the colour every camera is stored
in, and each camera's stored size. Whatever fails here fails in one line with nothing written
(a usage error, exit 2, when a flag names what the dataset does not have)."""

from __future__ import annotations

import dataclasses

from loongforge.preprocess.stages.colorspace import ColorTarget, dataset_colors
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.stages.convert import ConvertParams
from loongforge.preprocess.stages.discover import EpisodeSpec, SourceMeta, discover
from loongforge.preprocess.stages.timing import FrameTiming
from loongforge.shared.errors import ConfigError, SourceDataError
from loongforge.shared.split import choose_val_episodes


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    cfg: PreprocessConfig  # with the split resolved to episode ids
    meta: SourceMeta
    episodes: list[EpisodeSpec]
    color: ColorTarget


def prepare_job(cfg: PreprocessConfig) -> PreparedJob:
    meta, episodes = discover(cfg.input, cfg.fingerprint)
    if not episodes:  # the job's combines have no default: an empty input would publish nothing, silently
        raise SourceDataError(f"{cfg.input}: the dataset lists no episodes; nothing to convert")
    val = choose_val_episodes(cfg.val_episodes, [e.index for e in episodes], count=cfg.val_count,
                              fraction=cfg.val_fraction)
    cfg = dataclasses.replace(cfg, val_episodes=",".join(map(str, val)), val_count=0, val_fraction=0.0)
    camera_sizes(cfg, meta)  # an odd source size fails here, not in every worker
    has_video = any(c.kind == "video" for c in meta.cameras)
    color = dataset_colors(episodes, has_video, cfg.color_range, cfg.color_matrix)
    return PreparedJob(cfg, meta, episodes, color)


def camera_sizes(cfg: PreprocessConfig, meta: SourceMeta) -> tuple[tuple[int, int], ...]:
    """Each camera's stored (height, width): --height/--width for all when given, else each
    camera's own source size (info.json), never resampled."""
    if cfg.height is not None:
        return tuple((cfg.height, cfg.width) for _ in meta.cameras)
    for c in meta.cameras:
        if c.height % 2 or c.width % 2 or c.height <= 0 or c.width <= 0:
            raise ConfigError(f"camera {c.key}: source resolution {c.height}x{c.width} is not even (NV12 needs "
                              "even sizes); pass --height/--width")
    return tuple((c.height, c.width) for c in meta.cameras)


def resolve_params(cfg: PreprocessConfig, meta: SourceMeta, color: ColorTarget | None = None) -> ConvertParams:
    sizes = camera_sizes(cfg, meta)
    height, width = sizes[0]
    return ConvertParams(output=cfg.output, height=height, width=width, resize_mode=cfg.resize_mode,
                         zstd_level=cfg.zstd_level, slots=tuple(c.slot for c in meta.cameras), color=color,
                         block_frames=cfg.block_frames, block_codec=cfg.block_codec,
                         sizes=sizes if len(set(sizes)) > 1 else (),
                         timing=FrameTiming(cfg.timestamp_tolerance_s, cfg.frame_mismatch))
