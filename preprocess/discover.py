"""Stage 1: read a LeRobot v2.x dataset's `meta/` and list its episodes.

Runs once on the launcher (metadata only, no video). Real datasets ship with
inconsistent metadata (GR00T's own sample data among them): `total_chunks: 0`,
`splits` naming episodes that do not exist, cameras in `info.json` that have no
video files. Each is tolerated with a warning (logged and recorded in the index
under `source.warnings`), because the files themselves are the truth: chunks are
derived from `chunks_size`, a camera with no files at all is dropped. Problems
of one episode (missing parquet or video) are left for the convert stage, which
reports them as failed records instead of stopping the job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field

from loongforge.preprocess import files
from loongforge.shared import paths
from loongforge.shared.errors import SourceDataError

log = logging.getLogger(__name__)
META_FILES = ("info.json", "modality.json", "episodes.jsonl", "tasks.jsonl")
DEFAULT_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
DEFAULT_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"


@dataclass(frozen=True, slots=True)
class CameraSource:
    key: str  # observation.images.ego_view
    slot: str  # ego_view
    height: int
    width: int
    codec: str


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    index: int
    length: int  # from episodes.jsonl; -1 when unknown
    tasks: tuple[str, ...]
    parquet: str  # full path or URL
    videos: tuple[tuple[str, str], ...]  # (camera key, full path or URL)


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


def _names(feature: dict) -> tuple[str, ...]:
    names = feature.get("names")
    if isinstance(names, dict):  # LeRobot also writes {"motors": [...]}
        names = [n for group in names.values() for n in (group if isinstance(group, list) else [group])]
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


def _jsonl(raw: bytes, origin: str) -> list[dict]:
    rows = []
    for line_no, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise SourceDataError(f"{origin}:{line_no}: not JSON ({exc})") from exc
    return rows


def _read_meta(root: str) -> dict[str, bytes]:
    found = {}
    for name in META_FILES:
        try:
            found[name] = files.read_bytes(files.join(root, "meta", name))
        except FileNotFoundError:
            pass
    if "info.json" not in found:
        raise SourceDataError(f"{root}: no meta/info.json; is this a LeRobot v2 dataset root?")
    return found


def _cameras(info: dict, root: str, listing: set[str], video_tpl: str, warn) -> list[CameraSource]:
    cams = []
    for key, feat in sorted(info.get("features", {}).items()):
        if feat.get("dtype") != "video":
            continue
        prefix = video_tpl.split("{video_key}")[0].split("{")[0]  # e.g. "videos/chunk-"
        if not any(f"/{key}/" in f for f in listing if f.startswith(prefix)):
            warn(f"camera {key} is listed in info.json but has no video files; dropping it")
            continue
        shape = feat.get("shape", [0, 0, 3])
        names = feat.get("names") or ["height", "width", "channel"]
        dims = dict(zip(names, shape)) if len(names) == len(shape) else {}
        vinfo = feat.get("video_info") or feat.get("info") or {}
        cams.append(CameraSource(key=key, slot=paths.camera_slot(key), height=int(dims.get("height", shape[0])),
                                 width=int(dims.get("width", shape[1])),
                                 codec=str(vinfo.get("video.codec", "unknown"))))
    slots = [c.slot for c in cams]
    if len(set(slots)) != len(slots):
        raise SourceDataError(f"{root}: camera keys {[c.key for c in cams]} map to clashing slots {slots}")
    return cams


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


def discover(root: str, fingerprint: str = "stat") -> tuple[SourceMeta, list[EpisodeSpec]]:
    """Dataset metadata and every episode, sorted by episode index. `fingerprint`:
    "stat" or "content" (see fingerprint_inputs)."""
    root = root.rstrip("/")
    warnings: list[str] = []

    def warn(msg: str) -> None:
        log.warning("%s: %s", root, msg)
        warnings.append(msg)

    raw = _read_meta(root)
    info = json.loads(raw["info.json"])
    data_tpl = info.get("data_path", DEFAULT_DATA_PATH)
    video_tpl = info.get("video_path", DEFAULT_VIDEO_PATH)
    chunks_size = int(info.get("chunks_size") or 1000)
    stats = {**files.stat_files(root, "videos"), **files.stat_files(root, "data")}
    listing = set(stats)
    if "episodes.jsonl" in raw:
        rows = _jsonl(raw["episodes.jsonl"], "meta/episodes.jsonl")
    else:
        warn("no meta/episodes.jsonl; listing episodes from the parquet files")
        rows = [{"episode_index": int(m.group(1))} for f in sorted(listing)
                if (m := re.search(r"episode_(\d+)\.parquet$", f))]
    rows = sorted(rows, key=lambda r: int(r["episode_index"]))
    _check_counts(info, len(rows), warn)
    cams = _cameras(info, root, listing, video_tpl, warn)
    if not cams:
        raise SourceDataError(f"{root}: no camera has video files; nothing to convert")
    episodes = []
    for row in rows:
        ep = int(row["episode_index"])
        loc = {"episode_chunk": ep // chunks_size, "episode_index": ep}
        videos = tuple((c.key, files.join(root, video_tpl.format(video_key=c.key, **loc))) for c in cams)
        episodes.append(EpisodeSpec(index=ep, length=int(row.get("length", -1)), tasks=tuple(row.get("tasks", ())),
                                    parquet=files.join(root, data_tpl.format(**loc)), videos=videos))
    tasks = {int(r["task_index"]): str(r["task"]) for r in _jsonl(raw.get("tasks.jsonl", b""), "meta/tasks.jsonl")}
    if "modality.json" not in raw:
        warn("no meta/modality.json; the index's modality will be empty")
    feats = info.get("features", {})
    state, action = feats.get("observation.state", {}), feats.get("action", {})
    meta = SourceMeta(
        uri=root, codebase_version=str(info.get("codebase_version", "")), robot_type=str(info.get("robot_type", "")),
        fps=float(info.get("fps", 0)), cameras=tuple(cams),
        state_dim=int((state.get("shape") or [0])[0]), action_dim=int((action.get("shape") or [0])[0]),
        state_names=_names(state), action_names=_names(action), tasks=tasks,
        modality=json.loads(raw["modality.json"]) if "modality.json" in raw else {},
        fingerprint=fingerprint_inputs(root, raw, stats, fingerprint), warnings=tuple(warnings))
    return meta, episodes
