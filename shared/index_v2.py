"""The index of shard format 2: a small JSON manifest plus binary tables.

`index.json` (format_version 2) holds what is small and global: dataset info,
job params (incl. block_size), the shard list (bytes + sha256), the table list
(bytes + sha256 + dtype + shape). Everything per episode or per block lives in
`.npy` tables under `index/`, which readers memory-map: every process on a
node shares the same page-cache pages and nothing is parsed per worker. Spec:
FORMAT.md, "Version 2".
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import numpy as np

from loongforge.shared import paths
from loongforge.shared.blocks import DEFAULT_BLOCK_CODEC, check_block_codec
from loongforge.shared.errors import FormatError, FormatVersionError
from loongforge.shared.index import FORMAT_NAME, CameraInfo, DatasetInfo, ShardEntry, ShardIndex, parse_document

log = logging.getLogger(__name__)
FORMAT_VERSION_V2 = 2
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
BLOCK_COLUMNS = ("offset", "length", "n_frames", "xxh3")
KNOWN_KEYS = {"format", "format_version", "created_by", "dataset", "params", "episodes", "frames", "blocks",
              "frame_bucket_shift", "shards", "tables", "failed", "split"}
MAX_BUCKET_SHIFT = 20


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
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION_V2, "created_by": created_by,
        "dataset": asdict(dataset), "params": params, "episodes": int(episodes), "frames": int(frames),
        "blocks": int(blocks), "frame_bucket_shift": int(bucket_shift), "shards": shards, "tables": tables,
        "failed": list(failed),
    }
    if val_episodes:
        doc["split"] = {"val_episodes": [int(e) for e in val_episodes]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def refuse_version(version, origin: str) -> FormatVersionError:
    if version == 1:
        return FormatVersionError(
            f"{origin}: format_version 1 (per-sample windows). Read it with loongforge.shared.reader.ShardReader, "
            "or rewrite it as version 2: `loongforge convert ROOT --to v2 OUT`")
    hint = "upgrade loongforge" if isinstance(version, int) and version > FORMAT_VERSION_V2 else \
        "re-run `loongforge preprocess --format-version 2` to rewrite the shards"
    return FormatVersionError(f"{origin}: format_version {version!r}, this reader reads {FORMAT_VERSION_V2}: {hint}")


def parse_manifest(raw: bytes | str, origin: str = "index.json") -> dict:
    """Validate a v2 manifest; returns the document (dict). Unknown versions are refused
    with the FORMAT.md hint, unknown top-level keys warned about and ignored."""
    doc = parse_document(raw, origin, FORMAT_VERSION_V2, refuse_version, KNOWN_KEYS, log)
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
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{origin}: malformed v2 manifest ({type(exc).__name__}: {exc})") from exc
    return doc


def shard_level_index(doc: dict) -> ShardIndex:
    """A ShardIndex listing only the shards (no samples): what OriginSource, the cache
    client and the cache daemon need, which work per shard and never look inside one."""
    shards = tuple(ShardEntry(name=s["name"], bytes=int(s["bytes"]), sha256=s["sha256"], keys=(), offsets=(),
                              lengths=(), frames=()) for s in doc["shards"])
    return ShardIndex(dataset=doc["_dataset"], shards=shards, params=doc.get("params", {}),
                      failed=tuple(doc.get("failed", ())), episodes=int(doc.get("episodes", 0)),
                      val_episodes=tuple(int(e) for e in doc.get("split", {}).get("val_episodes", ())),
                      format_version=FORMAT_VERSION_V2, created_by=doc.get("created_by", ""))


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
