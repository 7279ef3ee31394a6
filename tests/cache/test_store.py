"""Narrow in-process tests of the Store and its tiers: write-through bookkeeping, a full disk,
reports, the SSD rebuild (real tier files, real index; the coordinator is a recorder, since no
Redis is involved; a full disk is a write that raises ENOSPC, with the store's clock moved by hand)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

from loongforge.cache import store as store_module
from loongforge.cache.config import CacheConfig
from loongforge.cache.metrics import Metrics
from loongforge.cache.peer import _open_held
from loongforge.cache.store import Store
from loongforge.cache.tiers import Tier


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


class _Clock:
    """The store's clock, moved by hand (the only fake besides the full disk)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)


def _drain(store: Store) -> None:
    with store.lock:
        assert store.write_done.wait_for(lambda: store.ssd_pending == 0, timeout=10)


def test_full_ssd_turns_writes_off_with_one_warning_and_rechecks_with_backoff(synthetic_root, tmp_path,
                                                                               monkeypatch, caplog):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    size = index.shards[0].bytes
    cfg = CacheConfig(origin=root, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"),
                      ram_budget=int(2.2 * size), ssd_budget=8 * size, tier_recheck_s=5.0, tier_recheck_max_s=60.0)
    clock = _Clock()
    monkeypatch.setattr(store_module, "time", clock)
    store = Store(cfg, index, Metrics("n"), _Recorder)
    store.open()
    writes: list[str] = []
    real_write = store.ssd.write

    def disk_full(shard, data):
        writes.append(shard)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.ssd, "write", disk_full)

    def read_all():  # every shard twice in a row: a miss (2 RAM slots, 4 shards), then a RAM hit
        for name in s:
            for _ in range(2):
                assert store.get(name, "reader")["tier"] == "ram"
                store.release(name, "reader")
        _drain(store)

    gauge = lambda: store.metrics.registry.get_sample_value("loongforge_cache_tier_disabled", {"tier": "ssd"})  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="loongforge.cache.store"):
        for _ in range(3):
            read_all()
        assert writes == [s[0]]  # one write found the disk full; no write, spill or retry after it
        assert store.snapshot()["tiers"]["ssd"]["disabled"] and gauge() == 1
        assert store.metrics.snapshot()["hits"]["ram"] == 12  # RAM still serves
        clock.now += 4.9
        read_all()
        assert len(writes) == 1
        clock.now += 0.2  # the first re-check is due: one write tries, the disk is still full
        read_all()
        assert len(writes) == 2
        clock.now += 9.9  # the wait doubled to 10 s
        read_all()
        assert len(writes) == 2
        monkeypatch.setattr(store.ssd, "write", real_write)  # space was freed
        clock.now += 0.2
        read_all()
        assert not store.snapshot()["tiers"]["ssd"]["disabled"] and gauge() == 0
        assert len(store.ssd.entries) == 4  # written through again (each fill, each RAM spill)
    store.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tmpfs" not in r.getMessage()]
    assert len(warnings) == 1 and "disk full (ENOSPC)" in warnings[0] and "RAM-only" in warnings[0], warnings
    assert any("writable again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_report_of_an_intact_tier_file_keeps_it(synthetic_root, tmp_path):
    root, index = synthetic_root
    name = index.shards[0].name
    cfg = CacheConfig(origin=root, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"),
                      ram_budget=4 << 20, ssd_budget=4 << 20)
    store = Store(cfg, index, Metrics("n"), _Recorder)
    store.open()
    path = store.get(name, "reader")["path"]
    reply = store.report(name, "reader", "PermissionError: [Errno 13] Permission denied")
    assert reply == {"shard": name, "replaced": False, "problems": {}} and os.path.exists(path)
    counts = store.metrics.snapshot()
    assert counts["reports"] == {"intact": 1} and counts["fills"] == {"origin": 1} and counts["corrupt"] == {}
    store.close()


def test_rebuild_drops_files_others_may_write_and_restores_dir_modes(synthetic_root, tmp_path):
    root, index = synthetic_root
    s = [e.name for e in index.shards[:3]]
    tier = Tier("ssd", str(tmp_path / "ssd"), 1 << 30)
    tier.open_dir()
    for name in s:
        with open(os.path.join(root, name), "rb") as f:
            tier.write(name, f.read())
    shards_dir = os.path.dirname(tier.path(s[0]))
    os.chmod(shards_dir, 0o700)  # as an older build left it under umask 077: the group could not enter
    os.chmod(tier.path(s[1]), 0o666)  # anyone could have rewritten it
    os.unlink(tier.path(s[2]))
    os.symlink(os.path.join(root, s[2]), tier.path(s[2]))  # right size, but not the daemon's file
    kept, dropped = tier.rebuild(index, full=False)
    assert kept == [s[0]] and sorted(dropped) == s[1:]
    assert stat.S_IMODE(os.stat(shards_dir).st_mode) == 0o750


def test_ssd_disk_full_at_start_runs_ram_only_with_one_warning(synthetic_root, tmp_path, tiny_disk, caplog):
    """No room on the SSD's disk for the tier's directory, lock or marker: the daemon still starts,
    RAM-only, the tier reported disabled with the reason, and the SSD is never written."""
    root, index = synthetic_root
    with open(tiny_disk / "ballast", "wb", buffering=0) as f:  # fill the filesystem to the last block
        try:
            while True:
                f.write(bytes(4096))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    size = index.shards[0].bytes
    cfg = CacheConfig(origin=root, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tiny_disk / "ssd"),
                      ram_budget=8 * size, ssd_budget=8 * size)
    store = Store(cfg, index, Metrics("n"), _Recorder)
    with caplog.at_level(logging.WARNING, logger="loongforge.cache.store"):
        store.open()
        try:
            name = index.shards[0].name
            assert store.get(name, "reader")["tier"] == "ram"
            store.release(name, "reader")
            _drain(store)
            tiers = store.snapshot()["tiers"]["ssd"]
            assert tiers["disabled"] and "at start" in tiers["disabled_reason"]
            assert not store.ssd.entries
        finally:
            store.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tmpfs" not in r.getMessage()]
    assert len(warnings) == 1 and "disk full (ENOSPC) at start" in warnings[0], warnings
