"""Where shard bytes come from. The trainer and the dataset reader depend only on the
`ShardSource` protocol; the origin (here) and the cache client (cache/) both
implement it, so the cache is optional and a fallback is one object swap.
"""

from __future__ import annotations

from typing import Protocol

from loongforge.shared import paths, storage
from loongforge.shared.errors import IntegrityError
from loongforge.shared.index import ShardIndex


class ShardSource(Protocol):
    def read_shard(self, name: str) -> memoryview:
        """The whole shard, size- and hash-verified against the index."""

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset` of a shard (not hash-verified: a range
        cannot be checked against a whole-shard hash; the dataset reader checks
        each block's and each episode's arrays' xxh3 from the index)."""


class OriginSource:
    """Reads shards straight from the shard root: mmap for local paths, fsspec otherwise."""

    def __init__(self, root: str, index: ShardIndex):
        self.root = root
        self.index = index
        self._maps: dict[str, memoryview] = {}  # local shards, mapped once
        self._verified: set[str] = set()

    def _map(self, name: str, path: str) -> memoryview:
        view = self._maps.get(name)
        if view is None:
            view = self._maps[name] = storage.map_file(path)
        return view

    def _path(self, name: str) -> str:
        self.index.shard(name)  # rejects names not in the index (and traversal)
        return paths.join(self.root, name)

    def read_shard(self, name: str) -> memoryview:
        entry = self.index.shard(name)
        path = self._path(name)
        if not storage.is_local(path):
            data = memoryview(storage.read_bytes(path))
            storage.verify(data, name, entry.bytes, entry.sha256)
            return data
        data = self._map(name, path)
        # A mapped shard is hashed once: shards are immutable once published, and
        # re-hashing a whole shard per sample read would dominate a degraded cache.
        if name not in self._verified:
            storage.verify(data, name, entry.bytes, entry.sha256)
            self._verified.add(name)
        return data

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        path = self._path(name)
        if storage.is_local(path):
            view = self._map(name, path)
            if offset + length > len(view):
                raise IntegrityError(f"{name}: range {offset}+{length} beyond {len(view)} bytes: truncated shard")
            return view[offset : offset + length]
        return memoryview(storage.read_bytes(path, offset, length))
