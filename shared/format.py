"""The sample codec of the shard format (spec: FORMAT.md, version FORMAT_VERSION).

A sample is one training window. On disk it is a run of tar members sharing one
key, each member a 512-byte USTAR header plus data padded to 512 bytes:

    <key>.meta.json          episode, frame ids, timestamps, counts
    <key>.task.txt           language instruction, UTF-8
    <key>.state.npy          float32 (K, state_dim)
    <key>.action.npy         float32 (H, action_dim)
    <key>.<slot>.nv12.zst    zstd(uint8 (K, 3*h/2, w)), one per camera slot

`pack_sample` returns those members as one self-contained byte fragment, so a
shard is just fragments concatenated plus the end-of-archive marker, and a sample
is a (offset, length) byte range of it (recorded in the index).
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field

import numpy as np
import zstandard

from loongforge.shared.errors import FormatError, FormatVersionError
from loongforge.shared.paths import check_member_name

FORMAT_VERSION = 1
BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
NV12_SUFFIX = ".nv12.zst"
DEFAULT_ZSTD_LEVEL = 3


@dataclass(slots=True)
class Sample:
    key: str
    episode: int
    frame_indices: np.ndarray  # int64 (K,)
    timestamps: np.ndarray  # float64 (K,)
    frames: dict[str, np.ndarray]  # slot -> uint8 (K, 3*h/2, w), NV12
    state: np.ndarray  # float32 (K, state_dim)
    action: np.ndarray  # float32 (H, action_dim)
    action_valid: int  # rows of `action` that are real; the rest repeat the last
    task: str
    task_index: int = -1
    extra: dict = field(default_factory=dict)

    @property
    def num_frames(self) -> int:
        return int(self.frame_indices.shape[0])


def _member(name: str, data: bytes) -> bytes:
    check_member_name(name)
    info = tarfile.TarInfo(name)
    info.size = len(data)
    # Fixed header fields make shards byte-identical across runs and machines.
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
    pad = (-len(data)) % BLOCK
    return header + data + b"\0" * pad


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def pack_sample(sample: Sample, zstd_level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Encode one sample as a tar fragment. Deterministic for equal input."""
    k = sample.num_frames
    if sample.state.shape[0] != k or sample.timestamps.shape[0] != k:
        raise FormatError(f"{sample.key}: state/timestamps rows must equal frame count {k}")
    meta = {
        "format_version": FORMAT_VERSION,
        "episode": int(sample.episode),
        "frames": [int(i) for i in sample.frame_indices],
        "timestamps": [round(float(t), 6) for t in sample.timestamps],
        "num_frames": k,
        "task_index": int(sample.task_index),
        "action_valid": int(sample.action_valid),
        "cameras": sorted(sample.frames),
        **({"extra": sample.extra} if sample.extra else {}),
    }
    # A fresh compressor per call: zstd output is then a pure function of input
    # and level (no dictionary or window state carried across samples).
    cctx = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True, threads=0)
    parts = [
        _member(f"{sample.key}.meta.json", json.dumps(meta, sort_keys=True).encode()),
        _member(f"{sample.key}.task.txt", sample.task.encode("utf-8")),
        _member(f"{sample.key}.state.npy", _npy(sample.state.astype(np.float32, copy=False))),
        _member(f"{sample.key}.action.npy", _npy(sample.action.astype(np.float32, copy=False))),
    ]
    for slot in sorted(sample.frames):
        frames = sample.frames[slot]
        if frames.dtype != np.uint8 or frames.ndim != 3 or frames.shape[0] != k:
            raise FormatError(f"{sample.key}/{slot}: frames must be uint8 (K, 3h/2, w), got {frames.dtype} {frames.shape}")
        raw = np.ascontiguousarray(frames).data
        parts.append(_member(f"{sample.key}.{slot}{NV12_SUFFIX}", cctx.compress(raw)))
    return b"".join(parts)


def _header_checksum_ok(header: memoryview) -> bool:
    stored = header[148:156].tobytes().rstrip(b"\0 ")
    try:
        want = int(stored, 8)
    except ValueError:
        return False
    raw = header.tobytes()
    return want == sum(raw[:148]) + 8 * 32 + sum(raw[156:])


def split_members(buf: memoryview | bytes) -> dict[str, memoryview]:
    """Parse a sample fragment into {member name: zero-copy view of its data}.

    Hand-rolled because it runs per sample on the hot path: it touches only
    the 512-byte headers and never copies the payload (tarfile would)."""
    view = memoryview(buf)
    out: dict[str, memoryview] = {}
    pos, end = 0, len(view)
    while pos + BLOCK <= end:
        header = view[pos : pos + BLOCK]
        if header[0] == 0:  # end-of-archive padding
            break
        if not _header_checksum_ok(header):
            raise FormatError(f"bad tar header checksum at byte {pos}: truncated or corrupt shard")
        name = header[0:100].tobytes().split(b"\0", 1)[0].decode("utf-8")
        try:
            size = int(header[124:136].tobytes().strip(b"\0 ") or b"0", 8)
        except ValueError as exc:
            raise FormatError(f"bad size field in tar header for {name!r}") from exc
        check_member_name(name)
        start = pos + BLOCK
        if start + size > end:
            raise FormatError(f"member {name!r} runs past the end of its byte range: truncated shard")
        out[name] = view[start : start + size]
        pos = start + size + ((-size) % BLOCK)
    if not out:
        raise FormatError("empty sample fragment")
    return out


class SampleParts:
    """A parsed but not yet decoded sample: cheap to build, decode what you need."""

    __slots__ = ("key", "meta", "members")

    def __init__(self, buf: memoryview | bytes):
        members = split_members(buf)
        by_ext: dict[str, memoryview] = {}
        key = None
        for name, data in members.items():
            k, _, ext = name.partition(".")
            if key is None:
                key = k
            elif k != key:
                raise FormatError(f"sample fragment mixes keys {key!r} and {k!r}")
            by_ext[ext] = data
        if "meta.json" not in by_ext:
            raise FormatError(f"sample {key!r} has no meta.json member")
        self.key = key
        self.meta = json.loads(bytes(by_ext["meta.json"]))
        version = self.meta.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"sample {key!r} has format_version {version!r}; this LoongForge reads {FORMAT_VERSION}. "
                "Upgrade loongforge or re-run `loongforge preprocess` to rewrite the shards."
            )
        self.members = by_ext

    def array(self, name: str) -> np.ndarray:
        try:
            data = self.members[f"{name}.npy"]
        except KeyError:
            raise FormatError(f"sample {self.key!r} has no {name}.npy member") from None
        return _load_npy(data, f"{self.key}.{name}.npy")

    def frames_blob(self, slot: str) -> memoryview:
        try:
            return self.members[f"{slot}{NV12_SUFFIX}"]
        except KeyError:
            raise FormatError(f"sample {self.key!r} has no camera {slot!r}") from None

    def decode(self, height: int, width: int, slots: list[str] | None = None) -> Sample:
        slots = self.meta["cameras"] if slots is None else slots
        k = self.meta["num_frames"]
        frames = {}
        for slot in slots:
            out = np.empty((k, height * 3 // 2, width), dtype=np.uint8)
            decompress_into(self.frames_blob(slot), out)
            frames[slot] = out
        return Sample(
            key=self.key,
            episode=self.meta["episode"],
            frame_indices=np.asarray(self.meta["frames"], dtype=np.int64),
            timestamps=np.asarray(self.meta["timestamps"], dtype=np.float64),
            frames=frames,
            state=self.array("state"),
            action=self.array("action"),
            action_valid=self.meta["action_valid"],
            task=bytes(self.members.get("task.txt", b"")).decode("utf-8"),
            task_index=self.meta.get("task_index", -1),
            extra=self.meta.get("extra", {}),
        )


_DCTX = zstandard.ZstdDecompressor()
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple, int]] = {}  # header bytes -> (dtype, shape, data offset)


def _load_npy(data: memoryview, what: str) -> np.ndarray:
    """np.load parses each header with ast.literal_eval (13% of a decode
    worker's time). Headers repeat (same dtype and shape every sample), so a
    header seen once is decoded from a cache; anything else goes to np.load."""
    view = memoryview(data)
    if view[:8] == _NPY_MAGIC and len(view) >= 10:
        end = 10 + int.from_bytes(view[8:10], "little")
        key = view[10:end].tobytes()
        meta = _NPY_HEADERS.get(key)
        if meta is not None:
            dtype, shape, offset = meta
            count = int(np.prod(shape))
            if len(view) != offset + count * dtype.itemsize:
                raise FormatError(f"{what}: {len(view)} bytes do not match its header {shape} {dtype}")
            return np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise FormatError(f"{what}: not a valid .npy array ({exc})") from exc
    if (view[:8] == _NPY_MAGIC and b"'fortran_order': False" in key and not arr.dtype.hasobject
            and len(_NPY_HEADERS) < 256):
        _NPY_HEADERS[key] = (arr.dtype, arr.shape, end)
    return arr


def decompress_into(blob: memoryview | bytes, out: np.ndarray) -> None:
    """zstd-decompress straight into a preallocated uint8 buffer (no temp copy).
    Raises FormatError unless the payload fills `out` exactly."""
    target = memoryview(out).cast("B")
    reader = _DCTX.stream_reader(blob, read_across_frames=False)
    try:
        got = 0
        while got < len(target):
            n = reader.readinto(target[got:])
            if n == 0:
                break
            got += n
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise FormatError(f"corrupt zstd frame payload: {exc}") from exc
    if got != len(target) or extra:
        raise FormatError(f"frame payload decompressed to the wrong size: expected {len(target)} bytes")
