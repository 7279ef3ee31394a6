"""Per-worker block cache (train/data/block_cache.py)."""

import numpy as np
import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.data.block_cache import BlockCache


def _block(n):
    return lambda: np.zeros(n, np.uint8)


def test_lru_within_a_byte_budget_and_counters():
    cache = BlockCache(300)
    loads = []

    def load(key):
        def f():
            loads.append(key)
            return np.full(100, key, np.uint8)
        return f

    for key in (1, 2, 3, 1, 4, 2):  # 4 evicts 2 (least recently used: 1 was touched again)
        assert cache.get(key, load(key))[0] == key
    assert loads == [1, 2, 3, 4, 2]
    assert cache.counters() == {"hits": 1, "misses": 5, "evictions": 2, "bytes": 300, "blocks": 3}
    assert 3 not in cache and {1, 2, 4} <= {k for k in (1, 2, 3, 4) if k in cache}  # 2 evicted 3, not 1
    assert cache.bytes <= cache.budget


def test_served_blocks_are_read_only_and_oversized_blocks_are_not_kept():
    cache = BlockCache(50)
    block = cache.get("big", _block(100))
    assert block.shape == (100,) and not block.flags.writeable
    assert len(cache) == 0 and cache.bytes == 0
    cache.get("big", _block(100))
    assert cache.misses == 2 and cache.hits == 0


def test_zero_budget_disables_and_negative_is_an_error():
    cache = BlockCache(0)
    cache.get("a", _block(1))
    cache.get("a", _block(1))
    assert cache.misses == 2
    with pytest.raises(ConfigError):
        BlockCache(-1)
