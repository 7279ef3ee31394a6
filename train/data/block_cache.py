"""Per-worker LRU cache of decoded frame blocks, bounded in bytes.

A decoded block is B NV12 frames of one camera (256x256: 96 KiB a frame, 1.5 MiB at
B=16). The block order (order.py) brings a block's samples back within about one
shuffle window, so a worker keeping the last window's blocks decodes each once. Each
decode worker owns one cache (no sharing, no locks); the counters travel back with
every batch so the trainer can log the hit rate.

Evicted blocks are kept (a few) as the memory the next decode writes into (`spare`):
a fresh 1.5 MiB array per decode costs its page faults (measured once over 300 batches
of 32 on bench block-loader's output root: 7.2 per sample inline before, 0.3 after).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from loongforge.shared.errors import ConfigError


SPARES = 4  # evicted blocks kept for reuse: a batch's misses come a few at a time


class BlockCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ConfigError(f"data.block_cache_mb: {budget_bytes} bytes, must be >= 0 (0 = no cache)")
        self.budget = int(budget_bytes)
        self._blocks: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._spares: list[np.ndarray] = []  # evicted blocks' memory, written by the next decode of that shape

    def get(self, key: Hashable, load: Callable[[], np.ndarray]) -> np.ndarray:
        """The block under `key`, loading (decoding) it on a miss. The returned array is
        read-only: it may be served again to later samples."""
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            self.hits += 1
            return block
        self.misses += 1
        block = load()
        block.flags.writeable = False
        if block.nbytes <= self.budget:  # a block over the whole budget is served, not kept
            self._blocks[key] = block
            self.bytes += block.nbytes
            while self.bytes > self.budget:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes
                self.evictions += 1
                self._keep_spare(old)
        return block

    def spare(self, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous uint8 array of `shape` to decode a block into (a loader passes it as read_block's
        `out`): memory an evicted block occupied, else a new array. The caller must not hold a block once
        the cache evicted it: the filler copies frames out of a block before its next get()."""
        for i, arr in enumerate(self._spares):
            if arr.shape == shape:
                return self._spares.pop(i)
        return np.empty(shape, np.uint8)

    def _keep_spare(self, old: np.ndarray) -> None:
        root = old
        while isinstance(root.base, np.ndarray):  # a decode into a spare is a view of its first n frames
            root = root.base
        if root.dtype == np.uint8 and root.flags.c_contiguous and root.flags.owndata:
            root.flags.writeable = True  # the cache marked the block read-only; its memory is ours again
            self._spares.append(root)
            if len(self._spares) > SPARES:
                self._spares.pop(0)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def counters(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes,
                "blocks": len(self._blocks)}

    def clear(self) -> None:
        self._blocks.clear()
        self._spares.clear()
        self.bytes = 0
