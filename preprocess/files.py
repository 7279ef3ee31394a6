"""File access for the preprocess job on local paths and fsspec URLs.

The job runs on a laptop (local paths, the fast route through the OS) and on
Dataflow/Flink workers (gs://, s3:// through fsspec); every stage reads and
writes through these few functions so no stage cares which.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from loongforge.shared import storage


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


@contextmanager
def open_read(path: str) -> Iterator[BinaryIO]:
    if storage.is_local(path):
        with open(_local(path), "rb") as f:
            yield f
        return
    fs, p = _fs(path)
    with fs.open(p, "rb") as f:
        yield f


def read_bytes(path: str) -> bytes:
    return storage.read_bytes(path)


def size(path: str) -> int:
    if storage.is_local(path):
        return os.path.getsize(_local(path))
    fs, p = _fs(path)
    return int(fs.size(p))


def list_files(root: str, under: str) -> set[str]:
    """Every file below root/under, as paths relative to root (one listing call)."""
    base = join(root, under)
    if storage.is_local(base):
        local_root, local_base = _local(root).rstrip("/"), _local(base)
        out = set()
        for dirpath, _, names in os.walk(local_base):
            rel = os.path.relpath(dirpath, local_root).replace(os.sep, "/")
            out.update(f"{rel}/{n}" for n in names)
        return out
    fs, p = _fs(base)
    _, root_p = _fs(root)
    prefix = root_p.rstrip("/") + "/"
    return {f[len(prefix):] for f in fs.find(p) if f.startswith(prefix)}


_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "mtime_ns")  # fsspec backends differ


def stat_files(root: str, under: str) -> dict[str, tuple[int, str]]:
    """Every file below root/under -> (size, modification time as text), keyed
    like list_files (one listing call). Backends without a time give ""."""
    base = join(root, under)
    if storage.is_local(base):
        local_root = _local(root).rstrip("/")
        out = {}
        for dirpath, _, names in os.walk(_local(base)):
            rel = os.path.relpath(dirpath, local_root).replace(os.sep, "/")
            for n in names:
                st = os.stat(os.path.join(dirpath, n))
                out[f"{rel}/{n}"] = (st.st_size, str(st.st_mtime_ns))
        return out
    fs, p = _fs(base)
    _, root_p = _fs(root)
    prefix = root_p.rstrip("/") + "/"
    out = {}
    for name, info in fs.find(p, detail=True).items():
        if name.startswith(prefix):
            when = next((info[k] for k in _MTIME_KEYS if info.get(k) is not None), "")
            out[name[len(prefix):]] = (int(info.get("size") or 0), str(when))
    return out


def sha256_file(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_tree(path: str) -> None:
    if storage.is_local(path):
        shutil.rmtree(_local(path), ignore_errors=True)
        return
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def remove_file(path: str) -> None:
    if storage.is_local(path):
        try:
            os.unlink(_local(path))
        except FileNotFoundError:
            pass
        return
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p)
