"""Stage 1: read a LeRobot dataset's `meta/` and list its episodes (v2.0, v2.1, v3.0).

Runs once on the launcher (metadata only, no video). `codebase_version` picks the layout reader
(lerobot/per_episode.py, lerobot/chunked.py); any other version is refused here, before any work, with the
versions LoongForge reads (lerobot/meta.py). Inconsistent metadata that real datasets ship with
(GR00T's own sample data among them: `total_chunks: 0`, `splits` naming episodes that do not
exist, cameras in `info.json` that have no video files) is tolerated with a warning (logged and
recorded in the index under `source.warnings`), because the files themselves are the truth.
Problems of one episode (missing parquet or video) are left for the convert stage, which reports
them as failed records instead of stopping the job.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field

from loongforge.preprocess import files

from loongforge.preprocess.lerobot import chunked, per_episode
from loongforge.preprocess.lerobot.meta import ACTION_KEY, STATE_KEY, CameraSource, Column, cameras, check_version, \
    item_columns, \
    derived_modality, names, parse_json, vector_dim
from loongforge.shared.errors import SourceDataError, UnsupportedSourceError

log = logging.getLogger(__name__)
META_FILES = ("info.json", "modality.json", *per_episode.META_FILES, *chunked.META_FILES)
__all__ = ["CameraSource", "EpisodeSpec", "SourceMeta", "discover"]


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    index: int
    length: int  # from the episode metadata; -1 when unknown
    tasks: tuple[str, ...]
    parquet: str  # full path or URL
    videos: tuple[tuple[str, str], ...]  # (camera key, full path or URL) of every video camera
    # Per video camera, the episode's [from, to) seconds inside a file holding several episodes
    # (v3.0); () = each file is the episode's alone.
    spans: tuple[tuple[float, float], ...] = ()
    shared_parquet: bool = False  # the parquet holds other episodes too: rows are selected by episode_index


@dataclass(frozen=True, slots=True)
class SourceMeta:
    uri: str
    codebase_version: str
    robot_type: str
    fps: float
    cameras: tuple[CameraSource, ...]
    state_dim: int
    action_dim: int
    state_names: tuple[str, ...]
    action_names: tuple[str, ...]
    tasks: dict  # task_index (int) -> text
    modality: dict = field(default_factory=dict)
    fingerprint: str = ""
    warnings: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)  # LeRobot's own statistics, as LeRobotDataset loads them
    features: dict = field(default_factory=dict)  # info.json's features, as found
    shared_bytes: int = 0  # bytes of the data/video files that hold several episodes (v3.0), counted once
    columns: tuple[Column, ...] = ()  # the parquet columns of LeRobot's item, and the arrays that hold them

    @property
    def image_keys(self) -> tuple[str, ...]:
        return tuple(c.key for c in self.cameras if c.kind == "image")


def _read_meta(root: str) -> dict[str, bytes]:
    found = {}
    for name in META_FILES:
        try:
            found[name] = files.read_bytes(files.join(root, "meta", name))
        except FileNotFoundError:
            pass
    if "info.json" not in found:
        raise UnsupportedSourceError(f"{root}: no meta/info.json; is this a LeRobot dataset root?")
    return found


def _check_counts(info: dict, n_found: int, warn) -> None:
    if info.get("total_chunks") == 0 and n_found:
        warn("info.json says total_chunks: 0 but episodes exist; deriving chunks from chunks_size")
    if info.get("total_episodes") not in (None, n_found):
        warn(f"info.json says total_episodes: {info.get('total_episodes')}, found {n_found}")
    for split, spec in sorted((info.get("splits") or {}).items()):
        m = re.fullmatch(r"(\d+):(\d+)", str(spec))
        if m and int(m.group(2)) > n_found:
            warn(f"split {split!r} = {spec} goes beyond the {n_found} episodes found; ignoring splits")


def fingerprint_inputs(root: str, raw_meta: dict[str, bytes], stats: dict[str, tuple[int, str]],
                       mode: str = "stat") -> str:
    """sha256 over the meta/ files' content and every data/ and videos/ file:
    its size and mtime (mode "stat": a changed or truncated video changes it,
    for one listing call) or its content hash (mode "content": survives a copy
    to another place or store, costs a full read)."""
    h = hashlib.sha256()
    for name in sorted(raw_meta):
        h.update(f"{name}\0{len(raw_meta[name])}\0".encode() + raw_meta[name])
    for rel in sorted(stats):
        size, mtime = stats[rel]
        what = files.sha256_file(files.join(root, rel)) if mode == "content" else mtime
        h.update(f"{rel}\0{size}\0{what}\n".encode())
    return h.hexdigest()


def _has_videos(listing: set[str], video_tpl: str):
    prefix = video_tpl.split("{video_key}")[0].split("{")[0]  # e.g. "videos/chunk-" or "videos/"
    return lambda key: any(f"/{key}/" in f for f in listing if f.startswith(prefix))


def _episodes(root: str, version: str, info: dict, raw: dict, listing: set[str], cams, warn):
    """(EpisodeSpecs, tasks, LeRobot statistics, extra files for the fingerprint) of one layout."""
    if version == "v3.0":
        tables = chunked.episode_tables(root)
        specs = chunked.list_episodes(root, info, tables, cams)
        return specs, chunked.tasks(root), chunked.stats(raw, tables), \
            files.stat_files(root, "meta/episodes") | _optional_stat(root, "meta/tasks.parquet")
    rows = per_episode.episode_rows(raw, listing, warn)
    specs = per_episode.list_episodes(root, info, rows, cams)
    return specs, per_episode.tasks(raw), per_episode.stats(raw), {}


def parquet_columns(path: str) -> list[str] | None:
    """Column names of a data parquet from its footer alone; None when it cannot be read here (the
    convert stage reports that file, episode by episode)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with files.open_read(path) as f:
            return list(pq.ParquetFile(f).schema_arrow.names)
    except (OSError, pa.ArrowException):
        return None


def _optional_stat(root: str, rel: str) -> dict[str, tuple[int, str]]:
    try:
        return {rel: (files.size(files.join(root, rel)), "")}
    except FileNotFoundError:
        return {}


def discover(root: str, fingerprint: str = "stat") -> tuple[SourceMeta, list[EpisodeSpec]]:
    """Dataset metadata and every episode, sorted by episode index. `fingerprint`:
    "stat" or "content" (see fingerprint_inputs). UnsupportedSourceError (exit 2) for a
    dataset of another version or an unreadable meta/info.json."""
    root = root.rstrip("/")
    warnings: list[str] = []

    def warn(msg: str) -> None:
        log.warning("%s: %s", root, msg)
        warnings.append(msg)

    raw = _read_meta(root)
    info = parse_json(raw["info.json"], "meta/info.json")
    version = check_version(info, "meta/info.json")
    stats = {**files.stat_files(root, "videos"), **files.stat_files(root, "data")}
    listing = set(stats)
    video_tpl = info.get("video_path") or (chunked.VIDEO_PATH if version == "v3.0" else per_episode.VIDEO_PATH)
    cams = cameras(info, _has_videos(listing, video_tpl), warn)
    if not cams:
        raise SourceDataError(f"{root}: no camera feature (video or image) has data; nothing to convert")
    specs, tasks, lerobot_stats, extra = _episodes(root, version, info, raw, listing, cams, warn)
    _check_counts(info, len(specs), warn)
    feats = info.get("features") or {}
    state, action = feats.get(STATE_KEY) or {}, feats.get(ACTION_KEY) or {}
    state_dim, action_dim = vector_dim(state), vector_dim(action)
    if "modality.json" in raw:
        modality = parse_json(raw["modality.json"], "meta/modality.json")
    else:
        modality = derived_modality(info, cams, state_dim, action_dim)
        warn("no meta/modality.json; state/action groups derived from info.json's feature names: "
             f"state {sorted(modality['state'])}, action {sorted(modality['action'])}")
    columns = item_columns(feats, parquet_columns(specs[0]["parquet"]) if specs else None, warn)
    meta = SourceMeta(
        uri=root, codebase_version=version, robot_type=str(info.get("robot_type") or ""),
        fps=float(info.get("fps", 0)), cameras=tuple(cams), state_dim=state_dim, action_dim=action_dim,
        state_names=names(state), action_names=names(action), tasks=tasks, modality=modality,
        fingerprint=fingerprint_inputs(root, raw, {**stats, **extra}, fingerprint), warnings=tuple(warnings),
        stats=lerobot_stats, features=feats,
        columns=columns,
        shared_bytes=sum(size for size, _ in stats.values()) if version == "v3.0" else 0)
    return meta, [EpisodeSpec(**s) for s in specs]
