"""The global shard index (`index.json`): schema, validation, load and save.

One versioned JSON document at the shard root, written last (after every shard
it names), so its presence means the shard set is complete. Spec: FORMAT.md.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property

import xxhash

from loongforge.shared import paths
from loongforge.shared.errors import FormatError, FormatVersionError, IntegrityError
from loongforge.shared.format import FORMAT_VERSION
from loongforge.shared.storage import read_bytes, write_bytes_atomic

log = logging.getLogger(__name__)
FORMAT_NAME = "loongforge-shards"
COLOR_MATRICES = ("bt601", "bt709")
COLOR_RANGES = ("limited", "full")
# Optional top-level key: {shard name: [xxh3_64 hex digest of each sample's byte range]}.
# Top level, not inside each shard entry, because readers of format 1 warn about
# and ignore unknown top-level keys but refuse unknown keys in a shard entry.
CHECKSUM_KEY = "sample_xxh3"
KNOWN_KEYS = {"format", "format_version", "created_by", "episodes", "dataset", "params", "shards", "failed",
              "split", CHECKSUM_KEY}


def parse_document(raw: bytes | str, origin: str, version: int,
                   refuse: Callable[[object, str], FormatVersionError], known: set[str],
                   logger: logging.Logger) -> dict:
    """The checks every index.json reader (format 1 here, format 2 in index_v2) starts with:
    valid JSON, our format name, the one version this reader reads (else `refuse(version,
    origin)` is raised), and a warning (on the caller's logger) for each unknown top-level key."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{origin}: not valid JSON ({exc}); the file is truncated or not an index") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{origin}: not a LoongForge shard index (format != {FORMAT_NAME!r})")
    if doc.get("format_version") != version:
        raise refuse(doc.get("format_version"), origin)
    for key in sorted(set(doc) - known):
        logger.warning("%s: ignoring unknown key %r (written by a newer LoongForge?)", origin, key)
    return doc


def _refuse_version(version, origin: str) -> FormatVersionError:
    hint = "upgrade loongforge" if isinstance(version, int) and version > FORMAT_VERSION else \
        "re-run `loongforge preprocess` to rewrite the shards"
    if version == 2:  # FORMAT.md: a v2 root has its own reader
        hint = "a version-2 root: open it with loongforge.shared.dataset_v2.open_v2 (or upgrade loongforge)"
    return FormatVersionError(f"{origin}: format_version {version!r}, this LoongForge reads {FORMAT_VERSION}: {hint}")


@dataclass(frozen=True, slots=True)
class CameraInfo:
    key: str  # the dataset's key, e.g. observation.images.ego_view
    slot: str  # member-name slot, e.g. ego_view
    source_height: int
    source_width: int
    codec: str = ""

    def __post_init__(self):
        if paths.camera_slot(self.slot) != self.slot:
            raise FormatError(f"camera slot {self.slot!r} is not a safe member name")


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

    @property
    def frame_bytes(self) -> int:
        """Bytes of one decoded NV12 frame of one camera."""
        return self.height * self.width * 3 // 2


@dataclass(frozen=True, slots=True)
class ShardEntry:
    name: str  # relative to the shard root, e.g. shards/shard-000000.tar
    bytes: int
    sha256: str
    keys: tuple[str, ...]
    offsets: tuple[int, ...]  # byte offset of each sample's first tar header
    lengths: tuple[int, ...]  # bytes of each sample's fragment
    frames: tuple[int, ...]  # frames per sample (for length bucketing)
    xxh3: tuple[str, ...] = ()  # xxh3_64 hex digest of each sample's byte range; () in indexes written before it

    def __post_init__(self):
        paths.check_relative(self.name)
        n = len(self.keys)
        if not (len(self.offsets) == len(self.lengths) == len(self.frames) == n):
            raise FormatError(f"shard {self.name}: per-sample lists differ in length")
        if self.xxh3 and len(self.xxh3) != n:
            raise FormatError(f"shard {self.name}: {len(self.xxh3)} sample checksums for {n} samples")
        if len(self.sha256) != 64:
            raise FormatError(f"shard {self.name}: sha256 must be 64 hex digits")
        for off, length in zip(self.offsets, self.lengths):
            if off < 0 or length <= 0 or off + length > self.bytes:
                raise FormatError(f"shard {self.name}: sample range {off}+{length} outside {self.bytes} bytes")

    @property
    def samples(self) -> int:
        return len(self.keys)

    def check_sample(self, local: int, data) -> None:
        """Raise IntegrityError unless `data` (sample `local`'s byte range) matches
        its recorded xxh3_64. Called on every range read: a range cannot be checked
        against the whole-shard sha256, and one flipped bit in a state array would
        otherwise reach training as a valid sample. xxh3 over the compressed range
        costs a few % of a decode worker's CPU time, zlib.crc32 about 3x that."""
        if self.xxh3 and xxhash.xxh3_64_hexdigest(data) != self.xxh3[local]:
            raise IntegrityError(f"{self.name}: sample {self.keys[local]} (bytes {self.offsets[local]}+"
                                 f"{self.lengths[local]}) does not match its xxh3 in the index: corrupt shard; "
                                 "re-fetch it or re-run `loongforge preprocess`")


@dataclass(frozen=True)  # no slots: cached_property needs __dict__
class ShardIndex:
    dataset: DatasetInfo
    shards: tuple[ShardEntry, ...]
    params: dict = field(default_factory=dict)  # the job parameters that made these shards
    failed: tuple[dict, ...] = ()  # {"episode", "camera", "reason"} per failed record
    episodes: int = 0
    val_episodes: tuple[int, ...] = ()  # validation split by episode (shared/split.py); () = all train
    format_version: int = FORMAT_VERSION
    created_by: str = ""

    def __post_init__(self):
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise FormatError("index lists a shard twice")

    # -- derived totals -------------------------------------------------------
    @cached_property
    def _starts(self) -> list[int]:
        starts, total = [], 0
        for s in self.shards:
            starts.append(total)
            total += s.samples
        return starts

    # Cached: the index is immutable and `locate` (per sample read) checks the
    # range; re-summing 2,000 shards cost 242 us per read.
    @cached_property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @cached_property
    def num_frames(self) -> int:
        """Window frames stored, per camera (overlapping windows count again)."""
        return sum(sum(s.frames) for s in self.shards)

    @cached_property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @cached_property
    def _by_name(self) -> dict[str, ShardEntry]:
        return {s.name: s for s in self.shards}

    def shard(self, name: str) -> ShardEntry:
        """Entry by name. Called per sample read (cache client, origin), so a
        dict lookup; a name that is not a key is checked for traversal, then refused."""
        entry = self._by_name.get(name)
        if entry is None:
            paths.check_relative(name)
            raise KeyError(f"shard {name!r} is not in the index")
        return entry

    def locate(self, sample: int) -> tuple[int, int]:
        """Global sample number -> (shard number, sample number inside it)."""
        if not 0 <= sample < self.num_samples:
            raise IndexError(f"sample {sample} out of range [0, {self.num_samples})")
        shard = bisect.bisect_right(self._starts, sample) - 1
        return shard, sample - self._starts[shard]

    def shard_start(self, shard: int) -> int:
        return self._starts[shard]

    def summary(self) -> dict:
        return {
            "format_version": self.format_version,
            "episodes": self.episodes,
            "samples": self.num_samples,
            "frames": self.num_frames,
            "shards": len(self.shards),
            "bytes": self.total_bytes,
            "cameras": [c.key for c in self.dataset.cameras],
            "resolution": [self.dataset.height, self.dataset.width],
            "fps": self.dataset.fps,
            "failed": len(self.failed),
        }

    # -- (de)serialisation ----------------------------------------------------
    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_by": self.created_by,
            "episodes": self.episodes,
            "dataset": asdict(self.dataset),
            "params": self.params,
            "shards": [{k: v for k, v in asdict(s).items() if k != "xxh3"} for s in self.shards],
            "failed": list(self.failed),
        }
        if self.val_episodes:  # absent when unsplit, so older indexes keep their bytes
            doc["split"] = {"val_episodes": list(self.val_episodes)}
        if any(s.xxh3 for s in self.shards):
            doc[CHECKSUM_KEY] = {s.name: list(s.xxh3) for s in self.shards if s.xxh3}
        # sort_keys + fixed separators: equal indexes are equal bytes.
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes | str, origin: str = "index.json") -> "ShardIndex":
        doc = parse_document(raw, origin, FORMAT_VERSION, _refuse_version, KNOWN_KEYS, log)
        version = doc["format_version"]
        try:
            ds = dict(doc["dataset"])
            ds["cameras"] = tuple(CameraInfo(**c) for c in ds["cameras"])
            ds["state_names"] = tuple(ds.get("state_names", ()))
            ds["action_names"] = tuple(ds.get("action_names", ()))
            checksums = doc.get(CHECKSUM_KEY) or {}
            shards = tuple(
                ShardEntry(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in s.items()},
                           xxh3=tuple(checksums.get(s["name"], ())))
                for s in doc["shards"]
            )
            return cls(
                dataset=DatasetInfo(**ds),
                shards=shards,
                params=doc.get("params", {}),
                failed=tuple(doc.get("failed", ())),
                episodes=int(doc.get("episodes", 0)),
                val_episodes=tuple(int(e) for e in doc.get("split", {}).get("val_episodes", ())),
                format_version=version,
                created_by=doc.get("created_by", ""),
            )
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{origin}: malformed index ({type(exc).__name__}: {exc})") from exc


def load_index(root: str) -> ShardIndex:
    """Read and validate `index.json` under a shard root (path or fsspec URL)."""
    path = paths.join(root, paths.INDEX_FILE)
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        raise FormatError(
            f"no {paths.INDEX_FILE} under {root!r}: not a shard root, or preprocess did not finish "
            "(the index is written last). Run `loongforge preprocess --input DATASET --output ROOT`."
        ) from None
    return ShardIndex.from_json(raw, origin=path)


def save_index(index: ShardIndex, root: str) -> str:
    """Write the index atomically (temp + rename). Call after every shard is in place."""
    path = paths.join(root, paths.INDEX_FILE)
    write_bytes_atomic(path, index.to_json())
    return path
