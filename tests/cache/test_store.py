"""Narrow in-process tests of the Store's write-through bookkeeping (real tier
files, real index; the coordinator is a recorder, since no Redis is involved)."""

from __future__ import annotations

import threading

from loongforge.cache.config import CacheConfig
from loongforge.cache.metrics import Metrics
from loongforge.cache.peer import _open_held
from loongforge.cache.store import Store


class _Recorder:
    def __init__(self, holdings):
        self.dropped_shards: list[str] = []

    def touch(self, shard):
        pass

    def dropped(self, shard):
        self.dropped_shards.append(shard)

    def fill(self, shard, from_origin, from_peer, deadline):
        return from_origin(), "origin", ""

    def finish(self, shard, token, published):
        pass


def test_ram_eviction_during_a_pending_write_through_keeps_the_shard_held(synthetic_root, tmp_path):
    root, index = synthetic_root
    s0, s1 = (e.name for e in index.shards[:2])
    size = index.shards[0].bytes
    cfg = CacheConfig(origin=root, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"),
                      ram_budget=int(1.2 * size), ssd_budget=4 * size)
    store = Store(cfg, index, Metrics("n"), _Recorder)
    store.open()
    gate = threading.Event()
    store.ssd_writer.submit(gate.wait, 30)  # hold the SSD writer: write-throughs stay pending
    try:
        assert store.get(s0, "reader")["tier"] == "ram"
        store.release(s0, "reader")
        assert store.get(s1, "reader")["tier"] == "ram"  # RAM (1 shard) evicts s0; its SSD write is pending
        assert s0 not in store.ram and s0 not in store.ssd and store.ssd_pending == 2
        assert store.coord.dropped_shards == []  # still held: the directory must keep listing this node
        served: list = []
        peer = threading.Thread(target=lambda: served.append(_open_held(store, s0)))
        peer.start()  # a peer asks for s0 now: the server must wait for the write, not answer 404
        peer.join(0.3)
        assert peer.is_alive() and served == []
    finally:
        gate.set()
        store.close()
    peer.join(10)
    with served[0] as f:
        assert f.read() == open(f"{root}/{s0}", "rb").read()
    assert s0 in store.ssd and s1 in store.ssd
    assert store.coord.dropped_shards == []


def test_tier_charges_whole_pages(tmp_path):
    from loongforge.cache.tiers import BASE_PAGE, Tier, huge_page_size

    hp = huge_page_size()
    small = Tier("ram", str(tmp_path / "a"), 1 << 30)  # 4 KiB pages (huge=never, or not tmpfs)
    assert [small.charge(n) for n in (0, 1, BASE_PAGE, BASE_PAGE + 1)] == [0, BASE_PAGE, BASE_PAGE, 2 * BASE_PAGE]
    always = Tier("ram", str(tmp_path / "b"), 1 << 30, huge="huge=always")
    assert always.charge(1) == hp and always.charge(hp + 1) == 2 * hp
    within = Tier("ram", str(tmp_path / "c"), 1 << 30, huge="huge=within_size")
    assert within.charge(100) == BASE_PAGE  # a huge page must fit inside i_size
    assert within.charge(hp + 1) == hp + BASE_PAGE
