"""What a LeRobot dataset's `meta/` says, whatever its version: the version check, the cameras
(video and image features), state/action names and their grouping, and the statistics.

Versions read (`codebase_version` in meta/info.json decides; anything else is refused before
any work, naming these):

    v2.0   one parquet and one mp4 per camera per episode; meta/episodes.jsonl, tasks.jsonl, stats.json
    v2.1   as v2.0, statistics per episode in meta/episodes_stats.jsonl
    v3.0   many episodes per parquet and per mp4 (LeRobot >= 0.4): meta/episodes/chunk-*/file-*.parquet
           (per episode: data file, video file, from/to timestamps), meta/tasks.parquet, stats.json

Feature types read: `video` (H.264, HEVC, AV1, any codec the bundled FFmpeg decodes) and `image`
(PNG or JPEG bytes inside the data parquet, LIBERO-style). Everything here reads metadata only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from loongforge.shared import paths
from loongforge.shared.errors import SourceDataError, UnsupportedSourceError

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
CAMERA_KINDS = ("video", "image")
STATE_KEY, ACTION_KEY = "observation.state", "action"
# Columns whose values an episode's required arrays already hold, as LeRobot returns them (FORMAT.md).
STANDARD_ARRAYS = {STATE_KEY: "state", ACTION_KEY: "action", "timestamp": "timestamp", "frame_index": "frame_index",
                   "index": "index", "task_index": "task_index"}
GR00T_TASK_COLUMN = "annotation.human.action.task_description"  # what the task_index array holds when present


@dataclass(frozen=True, slots=True)
class CameraSource:
    key: str  # observation.images.ego_view
    slot: str  # ego_view
    height: int
    width: int
    codec: str
    kind: str = "video"  # "video": frames in mp4 files; "image": PNG/JPEG bytes in the data parquet


@dataclass(frozen=True, slots=True)
class Column:
    """A parquet column LeRobotDataset returns in its item: info.json's non-camera features (the
    schema its `datasets` table is loaded with) that the data parquet holds. `dtype` and `shape`
    are the item's (LeRobot builds each value with `torch.tensor(python value)`: every float is
    float32, every integer int64; a shape-[1] feature is a scalar); `array` is the episode array
    holding the values ("" for episode_index, the episode's own id)."""

    name: str
    array: str
    dtype: str  # float32 | int64 | bool | str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {"array": self.array, "dtype": self.dtype, "shape": list(self.shape)}


def item_dtype(dtype: str) -> str | None:
    """The dtype of LeRobot's item value for a feature dtype; None for a non-tabular one."""
    if dtype == "bool":
        return "bool"
    if dtype in ("string", "str", "large_string"):
        return "str"
    if re.fullmatch(r"float(16|32|64)", dtype or ""):
        return "float32"
    if re.fullmatch(r"u?int(8|16|32|64)", dtype or ""):
        return "int64"
    return None


def _array_name(name: str, taken: set[str]) -> str:
    """A member-name-safe array name of its own for a column: 'next.done' -> 'col_next_done'."""
    base = "col_" + (re.sub(r"[^a-z0-9_]", "_", name.lower()).strip("_") or "x")
    out, k = base, 2
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def item_columns(features: dict, parquet_columns, warn) -> tuple[Column, ...]:
    """The columns of LeRobot's item, in info.json's order. `parquet_columns`: the data parquet's
    column names (None when unknown: every feature is assumed present). A feature whose dtype
    LeRobot does not read as a table value, or that the parquet lacks, is left out with a warning."""
    present = set(parquet_columns) if parquet_columns is not None else None
    taken: set[str] = set()
    out = []
    for name, feat in (features or {}).items():
        kind = feat.get("dtype") if isinstance(feat, dict) else None
        if kind in CAMERA_KINDS:
            continue
        dtype = item_dtype(str(kind))
        if dtype is None:
            warn(f"feature {name!r} has dtype {kind!r}, not a table value LoongForge stores; left out of the items")
            continue
        if present is not None and name not in present:
            warn(f"feature {name!r} is in info.json but not in the data parquet; left out of the items")
            continue
        shape = tuple(int(d) for d in (feat.get("shape") or [1]))
        shape = () if shape == (1,) else shape
        array = STANDARD_ARRAYS.get(name, "")
        gr00t = present is not None and GR00T_TASK_COLUMN in present
        if name == "task_index" and gr00t:
            array = ""  # the task_index array holds GR00T's task column: LeRobot's own gets an array of its own
        if name == GR00T_TASK_COLUMN and gr00t and dtype == "int64" and not shape:
            array = "task_index"
        if name == "episode_index":
            out.append(Column(name, "", dtype, shape))
            continue
        out.append(Column(name, array or _array_name(name, taken), dtype, shape))
    return tuple(out)


def parse_json(raw: bytes, origin: str):
    """One JSON document; a truncated or binary file is one line naming it (exit 2), not a traceback."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UnsupportedSourceError(f"{origin}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}): "
                                     "the file is binary or corrupt; restore it from the dataset's source") from None
    except ValueError as exc:
        raise UnsupportedSourceError(f"{origin}: not valid JSON ({exc}): the file is truncated or corrupt; "
                                     "restore it from the dataset's source") from None


def parse_jsonl(raw: bytes, origin: str) -> list[dict]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsupportedSourceError(f"{origin}: not UTF-8 text (offset {exc.start}): the file is binary or "
                                     "corrupt; restore it from the dataset's source") from None
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise UnsupportedSourceError(f"{origin}:{line_no}: not JSON ({exc})") from None
    return rows


def check_version(info, origin: str) -> str:
    """The dataset's codebase_version if LoongForge reads it; UnsupportedSourceError (exit 2) otherwise."""
    if not isinstance(info, dict):
        raise UnsupportedSourceError(f"{origin}: a JSON object was expected, found {type(info).__name__}")
    version = info.get("codebase_version")
    if version in SUPPORTED_VERSIONS:
        return version
    supported = ", ".join(SUPPORTED_VERSIONS)
    if version is None:
        hint = "no codebase_version: is this a LeRobot dataset root?"
    elif str(version).startswith("v1"):
        hint = "convert it to v2.1 or v3.0 with LeRobot's conversion scripts first"
    else:
        hint = "upgrade loongforge, or convert the dataset to v3.0 with LeRobot"
    raise UnsupportedSourceError(f"{origin}: codebase_version {version!r} is not supported; LoongForge reads LeRobot "
                                 f"datasets {supported} ({hint})")


def names(feature: dict) -> tuple[str, ...]:
    found = feature.get("names")
    if isinstance(found, dict):  # LeRobot also writes {"motors": [...]}
        found = [n for group in found.values() for n in (group if isinstance(group, list) else [group])]
    return tuple(str(n) for n in found) if isinstance(found, list) else ()


def _size(key: str, feature: dict) -> tuple[int, int]:
    shape = list(feature.get("shape") or [0, 0, 3])
    labels = feature.get("names") or ["height", "width", "channel"]
    dims = dict(zip(labels, shape)) if isinstance(labels, list) and len(labels) == len(shape) else {}
    try:
        return int(dims.get("height", shape[0])), int(dims.get("width", shape[1]))
    except (IndexError, TypeError, ValueError):
        raise SourceDataError(f"meta/info.json: feature {key} has shape {shape}, expected [height, width, channels]") \
            from None


def cameras(info: dict, has_video_files, warn) -> list[CameraSource]:
    """Every video and image feature, sorted by key. `has_video_files(key)`: whether any mp4 exists
    for a video feature (a camera listed in info.json without files is dropped with a warning)."""
    cams = []
    for key, feat in sorted((info.get("features") or {}).items()):
        kind = feat.get("dtype") if isinstance(feat, dict) else None
        if kind not in CAMERA_KINDS:
            continue
        if kind == "video" and not has_video_files(key):
            warn(f"camera {key} is listed in info.json but has no video files; dropping it")
            continue
        vinfo = feat.get("video_info") or feat.get("info") or {}
        height, width = _size(key, feat)
        codec = str(vinfo.get("video.codec", "unknown")) if kind == "video" else ""
        cams.append(CameraSource(key=key, slot=paths.camera_slot(key), height=height, width=width, codec=codec,
                                 kind=kind))
    slots = [c.slot for c in cams]
    if len(set(slots)) != len(slots):
        raise SourceDataError(f"camera keys {[c.key for c in cams]} map to clashing slots {slots}")
    return cams


_INDEX_SUFFIX = re.compile(r"(?:[_.\-\s]?\d+|\[\d+\])$")
_UNIT_SUFFIX = re.compile(r"\.(?:pos|vel|eff|effort|position|velocity|torque)$")


def _stem(name: str) -> str:
    """The group a dimension's name belongs to: 'left_arm_3' -> 'left_arm', 'q0' -> 'q',
    'elbow.pos' -> 'elbow'."""
    return _INDEX_SUFFIX.sub("", _UNIT_SUFFIX.sub("", name)) or name


def group_ranges(feature: dict, dim: int, fallback: str) -> dict:
    """{group: {"start", "end"}} over a vector feature's dimensions: the groups of a names dict
    ({"arm": [...], "gripper": [...]}), else runs of names sharing a stem, else one group."""
    raw = feature.get("names")
    if isinstance(raw, dict) and all(isinstance(v, list) for v in raw.values()) and len(raw) > 1:
        out, start = {}, 0
        for group, members in raw.items():
            out[str(group)] = {"start": start, "end": start + len(members)}
            start += len(members)
        if start == dim:
            return out
    flat = names(feature)
    if len(flat) != dim or not dim:
        return {fallback: {"start": 0, "end": dim}} if dim else {}
    out, start = {}, 0
    for i in range(1, dim + 1):
        if i == dim or _stem(flat[i]) != _stem(flat[start]):
            group = _stem(flat[start])
            out[group if group not in out else f"{group}_{start}"] = {"start": start, "end": i}
            start = i
    return out


def derived_modality(info: dict, cams: list[CameraSource], state_dim: int, action_dim: int) -> dict:
    """A GR00T modality.json from info.json's feature names, for datasets that ship none."""
    feats = info.get("features") or {}
    return {
        "state": group_ranges(feats.get(STATE_KEY) or {}, state_dim, "state"),
        "action": group_ranges(feats.get(ACTION_KEY) or {}, action_dim, "action"),
        "video": {c.slot: {"original_key": c.key} for c in cams},
        "annotation": {},
    }


def vector_dim(feature: dict) -> int:
    shape = feature.get("shape") or [0]
    try:
        return int(np.prod(shape))
    except (TypeError, ValueError):
        return 0


def aggregate_stats(per_episode: list[dict]) -> dict:
    """LeRobot's aggregation of per-episode statistics ({feature: {stat: list}}): min of mins, max of
    maxes, counts summed, count-weighted mean, the pooled std, quantiles count-weighted."""
    out: dict = {}
    for key in sorted({k for ep in per_episode for k in ep}):
        parts = [ep[key] for ep in per_episode if key in ep and "count" in ep[key]]
        if not parts:
            continue
        counts = np.array([float(np.asarray(p["count"]).reshape(-1)[0]) for p in parts])
        w = counts / counts.sum()
        agg: dict = {"count": [int(counts.sum())]}
        stats = {s for p in parts for s in p}
        if "min" in stats:
            agg["min"] = np.min([np.asarray(p["min"], np.float64) for p in parts], axis=0).tolist()
        if "max" in stats:
            agg["max"] = np.max([np.asarray(p["max"], np.float64) for p in parts], axis=0).tolist()
        if "mean" in stats:
            means = np.array([np.asarray(p["mean"], np.float64) for p in parts])
            mean = np.tensordot(w, means, axes=1)
            agg["mean"] = mean.tolist()
            if "std" in stats:
                second = np.array([np.asarray(p["std"], np.float64) ** 2 for p in parts]) + means**2
                agg["std"] = np.sqrt(np.maximum(np.tensordot(w, second, axes=1) - mean**2, 0.0)).tolist()
        for q in sorted(s for s in stats if re.fullmatch(r"q\d+", s)):
            agg[q] = np.tensordot(w, np.array([np.asarray(p[q], np.float64) for p in parts]), axes=1).tolist()
        out[key] = agg
    return out
