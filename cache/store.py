"""The node's shard store: RAM tier over SSD tier over remote (peer or origin).

`get` returns the path of a hash-verified tier file and pins the shard for
the reader (a lease). Every fill verifies the index hash. Placement spills
RAM -> SSD before dropping, never evicts a pinned or in-flight shard, and
asks policy.py which shard goes. When no tier can take a shard (all pinned,
disk full) the reply says tier "origin" and the client reads origin itself.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from loongforge.cache.config import format_bytes
from loongforge.cache.peer import fetch_from_peer, load_secret
from loongforge.cache.policy import PlanBook, Policy
from loongforge.cache.tiers import Tier, tmpfs_huge_option
from loongforge.shared import paths, storage
from loongforge.shared.errors import CacheError, ConfigError, IntegrityError, ShardNotFoundError
from loongforge.shared.index import ShardEntry, ShardIndex

log = logging.getLogger(__name__)


class Store:
    def __init__(self, cfg, index: ShardIndex, metrics, coord_factory):
        self.cfg, self.index, self.metrics = cfg, index, metrics
        self.entries = {s.name: s for s in index.shards}
        self.biggest = max((s.bytes for s in index.shards), default=1)
        self.ram_huge = tmpfs_huge_option(cfg.ram_dir)
        self.ram = Tier("ram", cfg.ram_dir, cfg.ram_budget, huge=self.ram_huge)
        self.ssd = Tier("ssd", cfg.ssd_dir, cfg.ssd_budget)
        cfg.check_index(index, charges={"ram_budget": self.ram.charge, "ssd_budget": self.ssd.charge})
        self.plans = PlanBook()
        self.policy = Policy(self.plans)
        self.lock = threading.RLock()
        self.leases: dict[str, dict[str, float]] = {}  # shard -> owner -> expiry (monotonic)
        self.inflight: dict[str, Future] = {}
        self.prefetched_at: dict[str, float] = {}
        self.wake = threading.Event()  # new plan or progress: prefetchers re-plan
        self.coord = coord_factory(self.holdings)
        self.peer_secret = load_secret(cfg)  # signs this node's fetches; the peer server checks them with it
        self.ssd_writer = ThreadPoolExecutor(1, thread_name_prefix="ssd-writer")
        self.ssd_pending = 0
        self.write_done = threading.Condition(self.lock)  # notified when an SSD write-through ends
        self._warned_disk_evict: set[str] = set()  # tiers whose first ENOSPC eviction was logged at WARNING

    # -- lifecycle -----------------------------------------------------------
    def open(self) -> None:
        try:
            _open_tier(self.ram)
            ssd_ok = self._open_ssd()
        except BaseException:
            self.ram.remove_dir()  # what open_dir made (lock, marker, data/), if it got the lock: no /dev/shm litter
            raise
        self.ram.wipe()  # RAM files of a previous run: not ours to trust, cheap to refill
        self.ram.open_dir()
        huge = self.ram_huge
        if huge is None:
            log.warning("ram tier %s is not on tmpfs: it is a disk tier in disguise; use /dev/shm or a tmpfs",
                        self.ram.root)
        elif huge in ("huge=never", "huge=deny"):
            log.info("ram tier %s is on 4 KiB tmpfs pages: readers copy shards faster from a tmpfs mounted "
                     "with huge=within_size (infra/cache/README.md; `loongforge bench cache` measures both)",
                     self.ram.root)
        t0 = time.monotonic()
        kept, dropped = self.ssd.rebuild(self.index, full=self.cfg.ssd_verify == "full") if ssd_ok else ([], [])
        for _ in dropped:
            self.metrics.inc("corrupt", "ssd")
        for s in kept:
            self.policy.touch(s)
        log.info("ssd tier %s: %d shards kept, %d dropped (%s check), in %.2fs",
                 self.ssd.root, len(kept), len(dropped), self.cfg.ssd_verify, time.monotonic() - t0)
        self._update_gauges()

    def close(self) -> None:
        self.ssd_writer.shutdown(wait=True)  # pending write-throughs finish: SSD stays complete
        with self.lock:
            self.ram.remove_dir()  # the README promises the RAM tier is gone after a graceful stop

    def holdings(self) -> list[str]:
        with self.lock:
            return sorted(set(self.ram.entries) | set(self.ssd.entries))

    # -- requests ------------------------------------------------------------
    def entry(self, name: str) -> ShardEntry:
        try:
            paths.check_relative(name)
        except ValueError:
            self.metrics.inc("rejected", "unsafe_path")
            raise
        entry = self.entries.get(name)
        if entry is None:
            self.metrics.inc("rejected", "not_in_index")
            raise ShardNotFoundError(f"shard {name!r} is not in the index of {self.cfg.origin}")
        return entry

    def get(self, name: str, owner: str, rank: int | None = None) -> dict:
        entry = self.entry(name)
        with self.lock:
            self.plans.consume(name, rank)
            self.policy.touch(name)
            self.coord.touch(name)
            tier = "ram" if name in self.ram else None
            if tier:
                self.metrics.inc("hits", "ram")
                self._pin(name, owner, "ram")
                lead = self.prefetched_at.pop(name, None)
                if lead is not None:
                    self.metrics.observe_lead(time.monotonic() - lead)
            else:
                self.metrics.inc("misses", "ram")
        self.wake.set()
        if tier is None:
            self._fill_once(entry, prefetch=False)
            tier = self._pin_where_held(name, owner)
        return self._reply(entry, tier)

    def _pin_where_held(self, name: str, owner: str) -> str:
        with self.lock:  # where it is now: a waiter's result may be stale, or evicted since
            tier = "ram" if name in self.ram else "ssd" if name in self.ssd else "origin"
            self._pin(name, owner, tier)
        return tier

    def _reply(self, entry: ShardEntry, tier: str) -> dict:
        self.metrics.inc("bytes_served", tier, entry.bytes)
        path = {"ram": self.ram, "ssd": self.ssd}[tier].path(entry.name) if tier != "origin" else None
        return {"shard": entry.name, "tier": tier, "path": path, "bytes": entry.bytes, "sha256": entry.sha256,
                "lease_s": self.cfg.lease_s}

    def report(self, name: str, owner: str, reason: str) -> dict:
        """A client refused the tier file it was handed for `name` (`reason`: its words, not trusted).
        Check each copy ourselves (owner, mode, size, sha256); drop the bad ones and fill the shard
        again, so this reader and the next are served from a tier instead of reading origin."""
        entry = self.entry(name)
        problems = {}
        for tier in (self.ram, self.ssd):
            with self.lock:
                held = name in tier
            problem = tier.check_file(name, entry.bytes, entry.sha256) if held else None
            if problem:
                problems[tier.name] = problem
        if not problems:
            self.metrics.inc("reports", "intact")
            log.info("a client refused its copy of %s (%r) but every copy passes the daemon's checks: kept",
                     name, reason)
            return {"shard": name, "replaced": False, "problems": {}}
        self.metrics.inc("reports", "replaced")
        log.warning("a client refused its copy of %s (%r); the daemon's own check agrees (%s): dropped, "
                    "filling it again", name, reason, "; ".join(f"{t} tier: {p}" for t, p in problems.items()))
        with self.lock:
            for tier in (self.ram, self.ssd):
                if tier.name in problems:
                    tier.remove(name)
                    self.metrics.inc("corrupt", tier.name)
            gone = name not in self.ram and name not in self.ssd and name not in self.ssd.reserved
        if gone:  # re-published once filled again; until then no peer should ask us for it
            self.coord.dropped(name)
        self._fill_once(entry, prefetch=False)
        return {**self._reply(entry, self._pin_where_held(name, owner)), "replaced": True, "problems": problems}

    def _pin(self, name: str, owner: str, tier: str) -> None:
        """Pin the copy the reader maps (RAM or SSD); the other tier's copy stays evictable."""
        self.leases.setdefault(name, {})[owner] = (time.monotonic() + self.cfg.lease_s, tier)

    def renew(self, names: list[str], owner: str) -> int:
        """A reader still maps `names`: extend its leases (re-pin after a reconnect). Returns how many."""
        for name in names:
            self.entry(name)
        renewed = 0
        with self.lock:
            for name in names:
                lease = self.leases.get(name, {}).get(owner)
                tier = lease[1] if lease else "ram" if name in self.ram else "ssd" if name in self.ssd else None
                if tier is not None:
                    self._pin(name, owner, tier)
                    renewed += 1
        return renewed

    def max_open(self) -> int:
        """Maps one client may keep (announced in `hello`): its pins may fill at most half the RAM
        tier, so prefetch and the other readers always find room."""
        return max(1, self.ram.budget // 2 // max(1, self.ram.charge(self.biggest)))

    def release(self, name: str, owner: str) -> None:
        with self.lock:
            owners = self.leases.get(name, {})
            owners.pop(owner, None)
            if not owners:
                self.leases.pop(name, None)

    def release_owner(self, owner: str) -> None:
        """A connection closed: its reader is gone, so are its pins."""
        with self.lock:
            for name in list(self.leases):
                self.release(name, owner)

    def pinned(self, tier: str | None = None) -> set[str]:
        """Shards with a live lease (in `tier`, or in any tier); expired leases are dropped."""
        now = time.monotonic()
        out = set()
        for name, owners in list(self.leases.items()):
            for owner, (expiry, where) in list(owners.items()):
                if expiry < now:
                    del owners[owner]  # lease expired: the reader did not renew
                elif tier is None or where == tier:
                    out.add(name)
            if not owners:
                del self.leases[name]
        return out

    def announce(self, rank: int, epoch: int, shards: list[str]) -> int:
        for s in shards:
            self.entry(s)  # reject the whole plan on one bad name
        with self.lock:
            self.plans.announce(rank, epoch, shards)
        self.coord.announce(rank, epoch, shards)
        self.wake.set()
        return len(shards)

    # -- filling ---------------------------------------------------------------
    def _fill_once(self, entry: ShardEntry, prefetch: bool, claimed: Future | None = None) -> str:
        """Fill `entry` into the tiers unless another thread already is; wait for it."""
        with self.lock:
            fut = claimed or self.inflight.get(entry.name)
            leader = claimed is not None or fut is None
            if fut is None:
                fut = self.inflight[entry.name] = Future()
        if leader:
            try:
                fut.set_result(self._fill(entry, prefetch))
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                with self.lock:
                    self.inflight.pop(entry.name, None)
        try:
            return fut.result(timeout=self.cfg.fill_timeout_s)
        except TimeoutError:
            raise CacheError(f"fill of {entry.name} exceeded fill_timeout_s={self.cfg.fill_timeout_s}") from None

    def _fill(self, entry: ShardEntry, prefetch: bool) -> str:
        name = entry.name
        data = None
        if name in self.ssd:
            t0 = time.monotonic()
            try:
                data = self.ssd.map(name)
                storage.verify(data, name, entry.bytes, entry.sha256)
                self.metrics.inc("hits", "ssd")
                self.metrics.inc("fills", "ssd")
                self.metrics.observe_fill("ssd", time.monotonic() - t0)
            except (IntegrityError, OSError) as exc:
                log.warning("ssd tier: %s failed verification (%s): dropped, refetching", name, exc)
                self.metrics.inc("corrupt", "ssd")
                data = None
                with self.lock:
                    self.ssd.remove(name)
                    gone = name not in self.ram
                if gone:  # refilled below and re-published; until then nobody should ask us for it
                    self.coord.dropped(name)
        if data is None:
            self.metrics.inc("misses", "ssd")
            data, token = self._fetch_remote(entry)
            in_ram = self._place(self.ram, name, data, prefetch)
            if in_ram:  # write-through to SSD off the reader's path; the bytes stay alive until written
                with self.lock:
                    self.ssd.reserved.setdefault(name, 0)  # "being written": RAM eviction need not spill it
                    self.ssd_pending += 1
                self.ssd_writer.submit(self._write_through, name, data, prefetch)
            held = in_ram or self._place(self.ssd, name, data, prefetch)
            self.coord.finish(name, token, published=held)
        else:
            in_ram = self._place(self.ram, name, data, prefetch)
        if prefetch and in_ram:
            self.metrics.inc("prefetches", "ram")
            with self.lock:
                self.prefetched_at[name] = time.monotonic()
        self._update_gauges()
        return "ram" if in_ram else "ssd" if name in self.ssd else "origin"

    def _write_through(self, name: str, data: bytes, prefetch: bool) -> None:
        with self.lock:
            self.ssd.reserved.pop(name, None)
        placed = False
        try:
            placed = self._place(self.ssd, name, data, prefetch)
        except Exception:  # noqa: BLE001 - SSD is an optimisation; RAM still serves the shard
            log.exception("ssd write-through of %s failed", name)
        finally:
            with self.lock:
                self.ssd_pending -= 1
                gone = not placed and name not in self.ram and name not in self.ssd
                if gone:  # RAM evicted it while the write was pending, and the write did not land
                    self.policy.forget(name)
                self.write_done.notify_all()
            if gone:
                self.coord.dropped(name)
        self._update_gauges()

    def _fetch_remote(self, entry: ShardEntry) -> tuple[bytes, str]:
        def from_origin() -> bytes:
            t0 = time.monotonic()
            if self.cfg.origin_delay_s:
                time.sleep(self.cfg.origin_delay_s)  # fault injection (tests): a slow origin
            path = paths.join(self.cfg.origin, entry.name)
            # Local origin: hash and copy straight from the page cache (an mmap), no extra read copy.
            data = storage.map_file(path) if storage.is_local(path) else storage.read_bytes(path)
            self.metrics.inc("fills", "origin")  # counted even if corrupt: it was an origin read
            self._verify_remote(data, entry, "origin")
            self.metrics.observe_fill("origin", time.monotonic() - t0)
            return data

        def from_peer(addr: str) -> bytes:
            t0 = time.monotonic()
            data = fetch_from_peer(addr, entry.name, timeout=self.cfg.fill_timeout_s, secret=self.peer_secret)
            self._verify_remote(data, entry, "peer")
            self.metrics.inc("fills", "peer")
            self.metrics.observe_fill("peer", time.monotonic() - t0)
            return data

        data, source, token = self.coord.fill(entry.name, from_origin, from_peer,
                                              deadline=time.monotonic() + self.cfg.fill_timeout_s)
        return data, token

    def _verify_remote(self, data: bytes, entry: ShardEntry, source: str) -> None:
        try:
            storage.verify(data, entry.name, entry.bytes, entry.sha256)
        except IntegrityError:
            self.metrics.inc("corrupt", source)
            raise

    def _place(self, tier: Tier, name: str, data, prefetch: bool) -> bool:
        """Write `name` into `tier`, evicting per policy. False if it cannot go there (full of pinned
        shards, or its disk is full: then it takes no writes until a re-check, see _disk_full)."""
        size = tier.charge(len(data))
        while True:  # each pass after the first follows an eviction: ends when nothing is left to evict
            with self.lock:
                if name in tier or name in tier.reserved:
                    return True  # present, or another thread is writing it right now
                recheck = tier.writes_off  # may_write lets one write through as the re-check
                if not tier.may_write(time.monotonic()) or not self._make_room(tier, name, size, prefetch):
                    return False
                tier.reserved[name] = size
            try:
                tier.write(name, data)
            except OSError as exc:
                with self.lock:
                    tier.reserved.pop(name, None)
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    log.error("%s tier: writing %s failed (%s): serving it from another tier", tier.name, name, exc)
                    return False
                self.metrics.inc("enospc", tier.name)
                if not recheck and self._evict_for_disk(tier, name, size, exc):
                    continue
                self._disk_full(tier, name, exc, recheck)
                return False
            with self.lock:
                tier.reserved.pop(name, None)
                tier.entries[name] = size
                back_on = tier.writes_off
                tier.turn_writes_on()
            if back_on:
                log.info("%s tier %s: writable again (the re-check wrote %s): taking new shards", tier.name,
                         tier.root, name)
                self._update_gauges()
            log.debug("%s tier: placed %s (%d bytes)", tier.name, name, size)
            return True

    def _evict_for_disk(self, tier: Tier, name: str, size: int, exc: OSError) -> bool:
        """The disk filled before the budget did: make room by evicting one of our shards, if any."""
        with self.lock:
            victim = self.policy.victim(tier.entries, exclude=self.pinned(tier.name) | set(self.inflight) | {name})
            if victim is None:
                return False
            self._evict(tier, victim)
        level = logging.DEBUG if tier.name in self._warned_disk_evict else logging.WARNING
        self._warned_disk_evict.add(tier.name)
        log.log(level, "%s tier %s: disk full (%s) writing %s (%d bytes) with %s of ours in it: budget %s "
                "exceeds the free space; evicted %s to make room (lower --%s-budget)", tier.name, tier.root,
                errno.errorcode.get(exc.errno, exc.errno), name, size, format_bytes(tier.used),
                format_bytes(tier.budget), victim, tier.name)
        return True

    def _open_ssd(self) -> bool:
        """Open the SSD tier; a disk already full at start (no room for its directory, lock or format
        marker) leaves this node RAM-only until the daemon restarts, with one WARNING, instead of a
        daemon that cannot start: a tier without its lock and marker must not take writes."""
        try:
            _open_tier(self.ssd, full_disk_ok=True)
            return True
        except OSError as exc:
            kind = errno.errorcode.get(exc.errno, str(exc.errno))
        self.ssd.turn_writes_off(time.monotonic(), math.inf, math.inf,
                                 f"disk full ({kind}) at start: restart the daemon once there is room")
        log.warning("ssd tier %s: disk full (%s) at start, no room for the tier's directory, lock or format "
                    "marker: this node runs RAM-only until the daemon restarts. Free space on that disk or point "
                    "--ssd-dir elsewhere", self.ssd.root, kind)
        return False

    def _disk_full(self, tier: Tier, name: str, exc: OSError, recheck: bool) -> None:
        """No room on the tier's disk and nothing of ours left to evict: the tier takes no writes until a
        re-check (one write, after tier_recheck_s, doubling while still full). One WARNING when it turns
        off; without this, every fill and every spill retried the write and logged an error."""
        kind = errno.errorcode.get(exc.errno, str(exc.errno))
        with self.lock:
            was_off = tier.writes_off
            if was_off and not recheck:
                return  # a write that began before the tier was turned off
            wait = tier.turn_writes_off(time.monotonic(), self.cfg.tier_recheck_s, self.cfg.tier_recheck_max_s,
                                        f"disk full ({kind}) with {format_bytes(tier.used)} of ours in it")
            held = len(tier.entries)
        self._update_gauges()
        if was_off:
            log.debug("%s tier %s: still full at the re-check (%s); next re-check in %gs", tier.name, tier.root,
                      kind, wait)
            return
        then = ("this node runs RAM-only for new shards (what the SSD holds is still served)" if tier is self.ssd
                else "new shards go to the SSD tier, or readers read origin")
        log.warning("%s tier %s: disk full (%s) writing %s, with %d shards (%s) of ours in it: the tier takes no "
                    "new shards; %s. Re-checking in %gs, backing off to %gs. Free space on that disk or lower "
                    "--%s-budget (%s)", tier.name, tier.root, kind, name, held, format_bytes(tier.used), then, wait,
                    self.cfg.tier_recheck_max_s, tier.name, format_bytes(tier.budget))

    def _make_room(self, tier: Tier, name: str, size: int, prefetch: bool) -> bool:
        """Evict until `size` more bytes fit (caller holds the lock)."""
        protect = self.pinned(tier.name) | set(self.inflight) | {name}
        if prefetch:
            protect |= set(self.plans.upcoming(self.cfg.prefetch_window))
        while tier.used + size > tier.budget:
            victim = self.policy.victim(tier.entries, exclude=protect)
            if victim is None:
                log.debug("%s tier full of pinned/in-flight shards; %s not placed there", tier.name, name)
                return False
            if prefetch and not self.policy.worth_prefetching(name, victim):
                return False
            self._evict(tier, victim)
        return True

    def _evict(self, tier: Tier, victim: str) -> None:
        """Drop `victim` from `tier`; RAM spills to SSD first if SSD lacks it."""
        if tier is self.ram and victim not in self.ssd:
            try:
                self._place(self.ssd, victim, self.ram.map(victim), prefetch=False)
            except OSError as exc:
                log.warning("spilling %s to ssd failed (%s); dropping it", victim, exc)
        tier.remove(victim)
        log.debug("%s tier: evicted %s", tier.name, victim)
        self.prefetched_at.pop(victim, None) if tier is self.ram else None
        self.metrics.inc("evictions", tier.name)
        if victim not in self.ram and victim not in self.ssd and victim not in self.ssd.reserved:
            # (a shard whose SSD write-through is pending is still held: it lands there shortly)
            self.policy.forget(victim)
            self.coord.dropped(victim)

    # -- prefetch --------------------------------------------------------------
    def next_prefetch(self) -> tuple[ShardEntry, Future] | None:
        """Claim the nearest announced shard that is not in RAM nor in flight."""
        with self.lock:
            upcoming = self.plans.upcoming(self.cfg.prefetch_window)
            for name in upcoming:
                if name in self.ram or name in self.inflight:
                    continue
                if not self._admissible(name, set(upcoming) | self.pinned("ram")):
                    return None  # RAM holds only nearer shards: prefetching would cause a miss
                fut = self.inflight[name] = Future()
                return self.entries[name], fut
        return None

    def _admissible(self, name: str, protect: set[str]) -> bool:
        """Dry run of _make_room(prefetch=True): would Belady admit `name` into RAM?"""
        need = self.ram.used + self.ram.charge(self.entries[name].bytes) - self.ram.budget
        ranked = sorted((s for s in self.ram.entries if s not in protect), key=self.policy.rank_key, reverse=True)
        for victim in ranked:
            if need <= 0:
                break
            if not self.policy.worth_prefetching(name, victim):
                return False
            need -= self.ram.entries[victim]
        return need <= 0

    def prefetch_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            while not stop.is_set() and (job := self.next_prefetch()) is not None:
                entry, fut = job
                try:
                    tier = self._fill_once(entry, prefetch=True, claimed=fut)
                except Exception as exc:  # noqa: BLE001 - a failed prefetch is retried by the read
                    log.warning("prefetch of %s failed: %s", entry.name, exc)
                    break
                if tier != "ram":
                    break  # RAM is full of nearer shards: wait for reads to make room

    def _update_gauges(self) -> None:
        for tier in (self.ram, self.ssd):
            self.metrics.tier_bytes.labels(tier.name).set(tier.used)
            self.metrics.tier_budget.labels(tier.name).set(tier.budget)
            self.metrics.tier_disabled.labels(tier.name).set(int(tier.writes_off))

    def snapshot(self) -> dict:
        with self.lock:
            return {"tiers": {"ram": self.ram.summary(), "ssd": self.ssd.summary()},
                    "pinned": len(self.pinned()), "inflight": len(self.inflight),
                    "ssd_pending": self.ssd_pending, "plans": self.plans.summary()}


def _open_tier(tier: Tier, full_disk_ok: bool = False) -> None:
    """tier.open_dir(), with what the OS refused (no permission on the parent, a read-only disk) said in
    one line naming the directory and the fix, not a traceback. A full disk stays an OSError when the
    caller can run without the tier (`full_disk_ok`: the SSD tier)."""
    try:
        tier.open_dir()
    except OSError as exc:
        if full_disk_ok and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(f"{tier.name} tier {tier.root}: cannot create or lock it: {exc.strerror}{where}. The daemon's "
                          f"user (uid {os.geteuid()}) must be able to write there: create the directory for it "
                          f"(install -d -o USER -m 0750 {tier.root}) or give --{tier.name}-dir a directory it owns") \
            from None
