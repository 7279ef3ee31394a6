"""Byte I/O on local paths and fsspec URLs, with atomic writes and hashing.

Local paths take the fast route (open/mmap/os.replace); anything with a URL
scheme goes through fsspec, so the same code reads s3://, gs://, http(s)://.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from loongforge.shared.errors import IntegrityError, LoongForgeError, StorageError

HASH_CHUNK = 8 << 20


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def read_bytes(path: str, start: int | None = None, length: int | None = None) -> bytes:
    if is_local(path):
        with open(_local(path), "rb") as f:
            if start is not None:
                f.seek(start)
            return f.read() if length is None else f.read(length)
    try:
        data = _read_remote(path, start, length)
    except (FileNotFoundError, LoongForgeError):
        raise  # a missing object is the caller's to explain (e.g. "not a shard root")
    except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types (botocore, aiohttp, ...)
        raise StorageError(
            f"could not read {path}: {type(exc).__name__}: {exc}. Check the URL, the credentials and endpoint "
            "in the environment (AWS_* for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://) and the network; "
            "for s3://, AWS_MAX_ATTEMPTS bounds the retries"
        ) from exc
    if start is None:
        return data
    if length is not None and len(data) != length:
        # Some HTTP servers ignore Range and send the whole object: slice it,
        # and refuse a short answer rather than hand back the wrong bytes.
        if len(data) > length and len(data) >= start + length:
            return data[start : start + length]
        raise IntegrityError(f"{path}: asked for {length} bytes at {start}, got {len(data)}: truncated object")
    return data


def _read_remote(path: str, start: int | None, length: int | None) -> bytes:
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    if start is None:
        return fs.cat_file(p)
    return fs.cat_file(p, start=start, end=None if length is None else start + length)


def map_file(path: str) -> memoryview:
    """Read-only zero-copy view of a local file (an mmap); empty files map to b''."""
    with open(_local(path), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def publish_mode(tmp: str) -> None:
    """mkstemp creates 0600; published files must be readable by the cache
    daemon and trainer, which may run as other users. Honour the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o644 & ~umask)


@contextmanager
def open_atomic(path: str) -> Iterator[BinaryIO]:
    """Stream a file into place. Local: temp file beside the target, fsync,
    then rename (readers see the old file or the whole new one, never half).
    Object stores: one upload on close (a PUT is already all-or-nothing)."""
    if not is_local(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        with fs.open(p, "wb") as f:
            yield f
        return
    path = _local(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str, data: bytes) -> None:
    with open_atomic(path) as f:
        f.write(data)


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> tuple[str, int]:
    """(hex digest, size) of a local file, streamed."""
    h, size = hashlib.sha256(), 0
    with open(_local(path), "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def verify(data: bytes | memoryview, name: str, size: int, sha256: str) -> None:
    if len(data) != size:
        raise IntegrityError(f"{name}: {len(data)} bytes, index says {size}: truncated or replaced")
    got = sha256_of(data)
    if got != sha256:
        raise IntegrityError(f"{name}: sha256 {got[:16]}… != index {sha256[:16]}…: corrupt; refetch or re-run preprocess")
