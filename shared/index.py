"""The index of a shard root: a small JSON manifest (`index.json`) plus binary tables.

`index.json` holds what is small and global: dataset info, job params (incl.
block_size), the shard list (bytes + sha256), the table list (bytes + sha256 +
dtype + shape). Everything per episode or per block lives in `.npy` tables under
`index/`, which readers memory-map: every process on a node shares the same
page-cache pages and nothing is parsed per worker. Written last, after every
shard and table it names, so its presence means the root is complete. Spec:
FORMAT.md. `parse_manifest` holds the one format-version check of every reader.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np

from loongforge.shared import paths
from loongforge.shared.blocks import DEFAULT_BLOCK_CODEC, check_block_codec
from loongforge.shared.errors import FormatError, FormatVersionError, UnsafePathError

log = logging.getLogger(__name__)
FORMAT_NAME = "loongforge-shards"
FORMAT_VERSION = 2
COLOR_MATRICES = ("bt601", "bt709")
COLOR_RANGES = ("limited", "full")
TABLE_DIR = "index"
# name -> (dtype, what one row holds). Shapes: (E,) / (E+1,) / (E, 3) / (E, C) / (NB, 4).
TABLES = {
    "episode_id": ("<i8", "source episode index"),
    "episode_shard": ("<i4", "shard number (position in `shards`)"),
    "episode_length": ("<i8", "frames T"),
    "episode_start": ("<i8", "E+1 prefix sums of T: episode e is global frames [start[e], start[e+1])"),
    "episode_arrays": ("<u8", "offset, length, xxh3_64 of the episode's .npy members (headers included)"),
    "first_block": ("<i8", "per camera: row in `blocks` of the episode's block 0"),
    "blocks": ("<u8", "offset, length, n_frames, xxh3_64 of one block's zstd bytes"),
    "frame_bucket": ("<i8", "episode row holding global frame k << frame_bucket_shift (O(1) locate)"),
}
KNOWN_KEYS = {"format", "format_version", "created_by", "dataset", "params", "episodes", "frames", "blocks",
              "frame_bucket_shift", "shards", "tables", "failed", "split"}
MAX_BUCKET_SHIFT = 20


@dataclass(frozen=True, slots=True)
class CameraInfo:
    key: str  # the dataset's key, e.g. observation.images.ego_view
    slot: str  # member-name slot, e.g. ego_view
    source_height: int
    source_width: int
    codec: str = ""
    # This camera's stored NV12 size when it differs from the dataset's height x width
    # (cameras kept at their own source sizes); 0 = the dataset's. Written only when set.
    height: int = 0
    width: int = 0

    def __post_init__(self):
        if paths.camera_slot(self.slot) != self.slot:
            raise FormatError(f"camera slot {self.slot!r} is not a safe member name")
        if (self.height == 0) != (self.width == 0) or self.height < 0 or self.width < 0 or self.height % 2 \
                or self.width % 2:
            raise FormatError(f"camera {self.key}: stored size {self.height}x{self.width} must be both 0 (the "
                              "dataset's) or both positive and even")


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    fps: float
    height: int
    width: int
    cameras: tuple[CameraInfo, ...]
    color_matrix: str = "bt601"
    color_range: str = "limited"
    state_dim: int = 0
    action_dim: int = 0
    action_horizon: int = 1
    frames_per_sample: int = 1
    state_names: tuple[str, ...] = ()
    action_names: tuple[str, ...] = ()
    modality: dict = field(default_factory=dict)  # modality.json as found
    stats: dict = field(default_factory=dict)  # {"state"|"action": {"mean","std","min","max": [...]}}
    source: dict = field(default_factory=dict)  # uri, codebase_version, robot_type, fingerprint
    tasks: dict = field(default_factory=dict)  # task_index (str) -> instruction
    # GR00T N1.6's embodiment of the data: tag, modality config, key layout, statistics (FORMAT.md); {} in
    # roots written before it (readers derive an absolute min/max config from `modality` and `stats`)
    embodiment: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.height <= 0 or self.width <= 0 or self.height % 2 or self.width % 2:
            raise FormatError(f"NV12 needs a positive even resolution, got {self.height}x{self.width}")
        if self.color_matrix not in COLOR_MATRICES:
            raise FormatError(f"color_matrix {self.color_matrix!r} not in {COLOR_MATRICES}")
        if self.color_range not in COLOR_RANGES:
            raise FormatError(f"color_range {self.color_range!r} not in {COLOR_RANGES}")
        if not self.cameras:
            raise FormatError("dataset has no cameras")

    @property
    def slots(self) -> list[str]:
        return [c.slot for c in self.cameras]

    def camera_size(self, camera: int) -> tuple[int, int]:
        """(height, width) of camera number `camera`'s stored frames."""
        c = self.cameras[camera]
        return (c.height, c.width) if c.height else (self.height, self.width)

    @property
    def uniform_size(self) -> bool:
        """Every camera stored at the dataset's height x width (what one batch tensor per camera needs)."""
        return all(self.camera_size(c) == (self.height, self.width) for c in range(len(self.cameras)))

    @property
    def frame_bytes(self) -> int:
        """Bytes of one decoded NV12 frame at the dataset's height x width."""
        return self.height * self.width * 3 // 2

    @property
    def timestep_bytes(self) -> int:
        """Bytes of one decoded NV12 frame of every camera together (one timestep)."""
        return sum(h * w * 3 // 2 for h, w in map(self.camera_size, range(len(self.cameras))))


@dataclass(frozen=True, slots=True)
class ShardEntry:
    name: str  # relative to the shard root, e.g. shards/shard-000000.tar
    bytes: int
    sha256: str

    def __post_init__(self):
        paths.check_relative(self.name)
        if len(self.sha256) != 64 or self.bytes < 0:
            raise FormatError(f"shard {self.name}: bad bytes/sha256")


@dataclass(frozen=True)  # no slots: cached_property needs __dict__
class ShardIndex:
    """The shard level of a root: which shard files exist, their sizes and hashes. What
    the origin source, the cache client and the cache daemon need: they work per shard
    and never look inside one (the tables say where blocks are)."""

    dataset: DatasetInfo
    shards: tuple[ShardEntry, ...]
    params: dict = field(default_factory=dict)
    failed: tuple[dict, ...] = ()
    episodes: int = 0
    val_episodes: tuple[int, ...] = ()
    created_by: str = ""

    def __post_init__(self):
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise FormatError("index lists a shard twice")

    @cached_property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @cached_property
    def _by_name(self) -> dict[str, ShardEntry]:
        return {s.name: s for s in self.shards}

    def shard(self, name: str) -> ShardEntry:
        """Entry by name. Called per range read (cache client, origin), so a dict lookup;
        a name that is not a key is checked for traversal, then refused."""
        entry = self._by_name.get(name)
        if entry is None:
            paths.check_relative(name)
            raise KeyError(f"shard {name!r} is not in the index")
        return entry

    def to_json(self) -> bytes:
        """Canonical bytes of the shard level (the cache daemon's per-dataset key space)."""
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dataset": dataset_doc(self.dataset),
               "params": self.params, "shards": [asdict(s) for s in self.shards], "episodes": self.episodes}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def dataset_doc(dataset: DatasetInfo) -> dict:
    """The manifest's `dataset` object: per-camera sizes only where set, so roots whose
    cameras share the dataset's size keep the bytes they had before per-camera sizes."""
    doc = asdict(dataset)
    if not doc["embodiment"]:  # roots without one keep the bytes they had
        del doc["embodiment"]
    for cam in doc["cameras"]:
        if not cam["height"]:
            del cam["height"], cam["width"]
    return doc


def table_name(table: str) -> str:
    return f"{TABLE_DIR}/{table}.npy"


def dataset_from_doc(ds: dict) -> DatasetInfo:
    ds = dict(ds)
    ds["cameras"] = tuple(CameraInfo(**c) for c in ds["cameras"])
    ds["state_names"] = tuple(ds.get("state_names", ()))
    ds["action_names"] = tuple(ds.get("action_names", ()))
    return DatasetInfo(**ds)


def manifest_json(*, dataset: DatasetInfo, params: dict, shards: list[dict], tables: dict[str, dict],
                  episodes: int, frames: int, blocks: int, bucket_shift: int, failed=(), val_episodes=(),
                  created_by: str = "") -> bytes:
    doc = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "created_by": created_by,
        "dataset": dataset_doc(dataset), "params": params, "episodes": int(episodes), "frames": int(frames),
        "blocks": int(blocks), "frame_bucket_shift": int(bucket_shift), "shards": shards, "tables": tables,
        "failed": list(failed),
    }
    if val_episodes:
        doc["split"] = {"val_episodes": [int(e) for e in val_episodes]}
    # sort_keys + fixed separators: equal indexes are equal bytes.
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def refuse_version(version, origin: str) -> FormatVersionError:
    if version == 1:
        return FormatVersionError(f"{origin}: format_version 1 (per-sample windows) is retired; rewrite the root as "
                                  "format 2 with `loongforge convert ROOT --to v2 OUT`")
    hint = "upgrade loongforge" if isinstance(version, int) and version > FORMAT_VERSION else \
        "re-run `loongforge preprocess` to rewrite the shards"
    return FormatVersionError(f"{origin}: format_version {version!r}, this LoongForge reads {FORMAT_VERSION}: {hint}")


def _document(raw: bytes | str, origin: str) -> dict:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{origin}: not valid JSON ({exc}); the file is truncated or not an index") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{origin}: not a LoongForge shard index (format != {FORMAT_NAME!r})")
    if doc.get("format_version") != FORMAT_VERSION:
        raise refuse_version(doc.get("format_version"), origin)
    for key in sorted(set(doc) - KNOWN_KEYS):
        log.warning("%s: ignoring unknown key %r (written by a newer LoongForge?)", origin, key)
    return doc


def parse_manifest(raw: bytes | str, origin: str = "index.json") -> dict:
    """Validate a manifest; returns the document (dict, plus "_dataset": its DatasetInfo).
    Another format version is refused with the FORMAT.md hint; unknown top-level keys
    are warned about and ignored; anything else unknown or malformed is refused."""
    doc = _document(raw, origin)
    try:
        block_size = doc["params"]["block_size"]
        if not isinstance(block_size, int) or block_size < 1:
            raise FormatError(f"{origin}: params.block_size {block_size!r} must be an integer >= 1")
        check_block_codec(doc["params"].get("block_codec", DEFAULT_BLOCK_CODEC), origin)  # absent: plain zstd
        for s in doc["shards"]:
            paths.check_relative(s["name"])
            if len(s["sha256"]) != 64 or int(s["bytes"]) < 0:
                raise FormatError(f"{origin}: shard {s['name']}: bad bytes/sha256")
        shift = doc["frame_bucket_shift"]
        if not isinstance(shift, int) or not 0 <= shift <= MAX_BUCKET_SHIFT:
            raise FormatError(f"{origin}: frame_bucket_shift {shift!r} must be an integer in 0..{MAX_BUCKET_SHIFT}")
        missing = sorted(set(TABLES) - set(doc["tables"]))
        if missing:
            raise FormatError(f"{origin}: tables {missing} missing")
        for name, t in doc["tables"].items():
            if t["name"] != table_name(name) or t["dtype"] != TABLES.get(name, (t["dtype"],))[0]:
                raise FormatError(f"{origin}: table {name!r} entry {t} does not match the spec")
        doc["_dataset"] = dataset_from_doc(doc["dataset"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, (FormatError, UnsafePathError)):  # path traversal stays its own kind of error
            raise
        raise FormatError(f"{origin}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    return doc


def shard_level_index(doc: dict) -> ShardIndex:
    """The ShardIndex of a parsed manifest (`parse_manifest`'s document)."""
    shards = tuple(ShardEntry(name=s["name"], bytes=int(s["bytes"]), sha256=s["sha256"]) for s in doc["shards"])
    return ShardIndex(dataset=doc["_dataset"], shards=shards, params=doc.get("params", {}),
                      failed=tuple(doc.get("failed", ())), episodes=int(doc.get("episodes", 0)),
                      val_episodes=tuple(int(e) for e in doc.get("split", {}).get("val_episodes", ())),
                      created_by=doc.get("created_by", ""))


def check_table(name: str, arr: np.ndarray, entry: dict, origin: str) -> np.ndarray:
    if arr.dtype != np.dtype(entry["dtype"]) or list(arr.shape) != list(entry["shape"]):
        raise FormatError(f"{origin}: table {name} is {arr.dtype} {arr.shape}, the manifest says {entry['dtype']} "
                          f"{tuple(entry['shape'])}: a table was replaced or truncated; re-run the writer")
    return arr


def bucket_shift(lengths: np.ndarray) -> int:
    """log2 of the frame_bucket width: at most the median episode length, so `locate`
    steps past about one episode boundary per lookup."""
    if not len(lengths):
        return 0
    return int(min(MAX_BUCKET_SHIFT, max(0, int(np.floor(np.log2(max(1.0, float(np.median(lengths)))))))))


def frame_buckets(start: np.ndarray, shift: int) -> np.ndarray:
    """Episode row holding global frame k << shift, for every k (start: the E+1 prefix sums)."""
    frames = int(start[-1])
    probes = np.arange(0, frames, 1 << shift, dtype=np.int64)
    return (np.searchsorted(start, probes, side="right") - 1).astype(np.int64)
