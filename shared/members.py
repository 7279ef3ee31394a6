"""Tar members of a shard: how one named byte payload is stored, found and decoded.

A shard is a plain POSIX tar file. Every member is a 512-byte USTAR header with
fixed fields (so equal input gives equal bytes) plus its data padded to 512
bytes, and a run of members is itself a valid tar stream. The episode codec
(blocks.py) writes `.npy` arrays and zstd frame blocks as members; readers parse
a byte range back into members without copying the payloads.
"""

from __future__ import annotations

import io
import tarfile
import threading

import numpy as np
import zstandard

from loongforge.shared.errors import FormatError
from loongforge.shared.paths import check_member_name

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
NV12_SUFFIX = ".nv12.zst"
DEFAULT_ZSTD_LEVEL = 3


def tar_member(name: str, data: bytes) -> bytes:
    """One member: header + data + padding. The name must be one safe component."""
    check_member_name(name)
    info = tarfile.TarInfo(name)
    info.size = len(data)
    # Fixed header fields make shards byte-identical across runs and machines.
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
    return header + data + b"\0" * ((-len(data)) % BLOCK)


def npy_bytes(array: np.ndarray) -> bytes:
    """`.npy` v1 bytes of a C-contiguous copy of `array`; never a pickle."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _header_checksum_ok(header: memoryview) -> bool:
    stored = header[148:156].tobytes().rstrip(b"\0 ")
    try:
        want = int(stored, 8)
    except ValueError:
        return False
    raw = header.tobytes()
    return want == sum(raw[:148]) + 8 * 32 + sum(raw[156:])


def split_members(buf: memoryview | bytes) -> dict[str, memoryview]:
    """Parse a run of members into {member name: zero-copy view of its data}.

    Hand-rolled because it runs on the hot path: it touches only the 512-byte
    headers and never copies the payload (tarfile would)."""
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
        raise FormatError("empty byte range: no tar member in it")
    return out


# One decompression context per thread: a context is not thread-safe, and an inline loader
# decodes in its prefetch thread while the main thread may read the same root (validation,
# the LeRobot adapter); a shared one corrupts both streams.
_LOCAL = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple, int]] = {}  # header bytes -> (dtype, shape, data offset)


def load_npy(data: memoryview | bytes, what: str) -> np.ndarray:
    """A `.npy` member's array (a writable copy). np.load parses each header with
    ast.literal_eval (13% of a decode worker's time); headers repeat (same dtype and
    shape every episode of a dataset), so a header seen once is decoded from a cache
    and anything else goes to np.load. Object arrays (pickles) are refused."""
    view = memoryview(data)
    key = b""
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
    reader = _dctx().stream_reader(blob, read_across_frames=False)
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
