"""Shard writing: concatenate sample fragments into one tar, hash it, and place
it atomically. Used by the preprocess job and by test/benchmark factories."""

from __future__ import annotations

import hashlib

import xxhash

from loongforge.shared import paths, storage
from loongforge.shared.format import END_OF_ARCHIVE
from loongforge.shared.index import ShardEntry


def layout_shard(name: str, fragments: list[tuple[str, int, bytes]]) -> tuple[ShardEntry, list[bytes]]:
    """Plan one shard from (key, frame count, fragment) triples, in order.
    Returns the index entry and the byte chunks to write (hash and per-sample xxh3 included)."""
    h = hashlib.sha256()
    keys, offsets, lengths, frames, digests, chunks = [], [], [], [], [], []
    pos = 0
    for key, n_frames, frag in fragments:
        keys.append(key)
        offsets.append(pos)
        lengths.append(len(frag))
        frames.append(n_frames)
        digests.append(xxhash.xxh3_64_hexdigest(frag))
        chunks.append(frag)
        h.update(frag)
        pos += len(frag)
    chunks.append(END_OF_ARCHIVE)
    h.update(END_OF_ARCHIVE)
    pos += len(END_OF_ARCHIVE)
    entry = ShardEntry(name=paths.check_relative(name), bytes=pos, sha256=h.hexdigest(), keys=tuple(keys),
                       offsets=tuple(offsets), lengths=tuple(lengths), frames=tuple(frames),
                       xxh3=tuple(digests))
    return entry, chunks


def write_shard(root: str, name: str, fragments: list[tuple[str, int, bytes]]) -> ShardEntry:
    """Write a shard under `root` (local or fsspec URL) atomically; return its entry."""
    entry, chunks = layout_shard(name, fragments)
    with storage.open_atomic(paths.join(root, name)) as f:
        for chunk in chunks:
            f.write(chunk)
    return entry
