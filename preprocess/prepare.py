"""Launcher-side checks and choices, before any work: the dataset's metadata and episodes
(discover), the validation split against the episodes found, the colour every camera is stored
in, and each camera's stored size. Whatever fails here fails in one line with nothing written
(a usage error, exit 2, when a flag names what the dataset does not have)."""

from __future__ import annotations

import dataclasses

import numpy as np

from loongforge.preprocess.stages.colorspace import ColorTarget, dataset_colors
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.stages.convert import ConvertParams
from loongforge.preprocess.stages.discover import EpisodeSpec, SourceMeta, discover
from loongforge.preprocess.stages.stats import EmbodimentSpec
from loongforge.preprocess.stages.timing import FrameTiming
from loongforge.shared import embodiment
from loongforge.shared.errors import ConfigError, SourceDataError, UsageError
from loongforge.shared.split import choose_val_episodes


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    cfg: PreprocessConfig  # with the split resolved to episode ids
    meta: SourceMeta
    episodes: list[EpisodeSpec]
    color: ColorTarget
    embodiment: EmbodimentSpec


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
    return PreparedJob(cfg, meta, episodes, color, resolve_embodiment(cfg, meta))


def resolve_embodiment(cfg: PreprocessConfig, meta: SourceMeta) -> EmbodimentSpec:
    """The tag and modality config the job records, checked against the dataset (a usage error naming the
    key and what the dataset has, before any work)."""
    tag = cfg.embodiment_tag or "new_embodiment"
    try:
        if cfg.embodiment_tag or cfg.modality_config:
            embodiment.projector_index(tag)  # an unknown tag: one line naming the known ones
            config = embodiment.resolve_config(tag, cfg.modality_config or None)
        else:
            config = embodiment.derive_config(meta.modality, [c.slot for c in meta.cameras], cfg.action_horizon)
        arrays = {c.name: c.array for c in meta.columns if c.array}
        arrays.setdefault("observation.state", "state")
        arrays.setdefault("action", "action")
        dims = {c.array: max(1, int(np.prod(c.shape))) for c in meta.columns if c.array}
        dims.update(state=meta.state_dim, action=meta.action_dim)
        layout = embodiment.key_layout(config, meta.modality, arrays, dims, {c.key: c.slot for c in meta.cameras},
                                       origin=cfg.input)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    floats = {c.name: c.array for c in meta.columns if c.dtype == "float32" and c.array}
    return EmbodimentSpec(tag=tag, config=config, layout=layout, float_features=floats,
                          registered=not cfg.modality_config and tag in embodiment.REGISTERED)


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


def resolve_params(cfg: PreprocessConfig, meta: SourceMeta, color: ColorTarget | None = None,
                   embodiment_spec: EmbodimentSpec | None = None) -> ConvertParams:
    sizes = camera_sizes(cfg, meta)
    height, width = sizes[0]
    return ConvertParams(output=cfg.output, height=height, width=width, resize_mode=cfg.resize_mode,
                         zstd_level=cfg.zstd_level, slots=tuple(c.slot for c in meta.cameras), color=color,
                         block_frames=cfg.block_frames, block_codec=cfg.block_codec,
                         sizes=sizes if len(set(sizes)) > 1 else (),
                         timing=FrameTiming(cfg.timestamp_tolerance_s, cfg.frame_mismatch),
                         embodiment=embodiment_spec)
