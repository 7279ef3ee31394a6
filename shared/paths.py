"""Every path template of a shard root, defined once.

A shard root (local directory or fsspec URL) holds:

    index.json                 the manifest, written last
    index/<table>.npy          binary tables (index.py), written before it
    shards/shard-000000.tar    webdataset-compatible shards
    failed.jsonl               records the preprocess job could not convert

Member names inside a shard (episode and block keys) are in blocks.py.
"""

from __future__ import annotations

import posixpath
import re

from loongforge.shared.errors import UnsafePathError

INDEX_FILE = "index.json"
FAILED_FILE = "failed.jsonl"
SHARD_DIR = "shards"
SHARD_TEMPLATE = "shard-{shard:06d}.tar"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_SAFE_CAMERA = re.compile(r"^[a-z0-9][a-z0-9_]*$")


def shard_name(shard: int) -> str:
    return f"{SHARD_DIR}/{SHARD_TEMPLATE.format(shard=shard)}"


def check_relative(name: str) -> str:
    """Validate a relative path from the index or a client: no absolute paths,
    no '..', no backslashes, every component a plain safe name."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"empty or non-string path: {name!r}")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise UnsafePathError(f"unsafe path {name!r}: must be relative, with '/' separators")
    if posixpath.normpath(name) != name:
        raise UnsafePathError(f"unsafe path {name!r}: not in normal form")
    for part in name.split("/"):
        if part in ("", ".", "..") or not _SAFE_NAME.match(part):
            raise UnsafePathError(f"unsafe path component {part!r} in {name!r}")
    return name


def check_member_name(name: str) -> str:
    """A tar member name inside a shard: one safe component, no directories."""
    check_relative(name)
    if "/" in name:
        raise UnsafePathError(f"shard member {name!r} must not contain '/'")
    return name


def camera_slot(camera_key: str) -> str:
    """LeRobot camera keys look like 'observation.images.ego_view'. Shard member
    names cannot hold dots, so each camera gets a slot name: 'ego_view'."""
    slot = camera_key.rsplit(".", 1)[-1].lower()
    slot = re.sub(r"[^a-z0-9_]", "_", slot)
    if not _SAFE_CAMERA.match(slot):
        raise UnsafePathError(f"cannot derive a camera slot name from {camera_key!r}")
    return slot


def join(root: str, name: str) -> str:
    """Join a shard root (path or URL) and a checked relative name."""
    check_relative(name)
    return root.rstrip("/") + "/" + name
