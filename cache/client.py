"""CacheClient: a `ShardSource` that asks the node's cache daemon for a tier
file and mmaps it. Cheap to construct in every trainer worker (connects
lazily, reconnects after fork). When the daemon is unreachable it falls back
to reading origin directly (unless fallback=False), and retries the daemon
after a backoff. No call blocks longer than `timeout` on the daemon.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time

from loongforge.cache.config import default_socket_path
from loongforge.cache.protocol import Connection, ProtocolError
from loongforge.shared.errors import CacheError, CacheUnavailableError, IntegrityError, ShardNotFoundError
from loongforge.shared.index import ShardIndex
from loongforge.shared.source import OriginSource

log = logging.getLogger(__name__)
RETRY_DAEMON_S = 5.0  # while degraded, how often to try the daemon again
__all__ = ["CacheClient", "default_socket_path"]


def _map(path: str, size: int) -> memoryview:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise IntegrityError(f"{path}: size differs from the index (replaced under us?)")
        if size == 0:
            return memoryview(b"")
        # MAP_POPULATE pre-faults the tmpfs pages in one go: reading then runs at memcpy speed.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ))


class CacheClient:
    def __init__(self, root: str, index: ShardIndex, *, socket_path: str | None = None, tcp: str | None = None,
                 fallback: bool = True, timeout: float = 5.0, max_open: int = 16):
        self.root = root
        self.index = index
        self.socket_path = socket_path or (None if tcp else default_socket_path())
        self.tcp = tcp
        self.fallback = fallback
        self.timeout = timeout
        self._origin: OriginSource | None = None
        self._conn: Connection | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        # Open shard maps, oldest first. Beyond max_open the oldest is released:
        # its pin goes, but a view the caller still holds stays valid (the
        # daemon unlinks, never overwrites), so only RAM accounting lags.
        self._maps: dict[str, memoryview] = {}
        self.max_open = max_open
        self._rank: int | None = None
        self._degraded_since: float | None = None
        self._warned = False
        self.counts = {"daemon_reads": 0, "origin_reads": 0, "daemon_errors": 0}

    @property
    def degraded(self) -> bool:
        return self._degraded_since is not None

    # -- daemon connection -----------------------------------------------------
    def _request(self, op: str, **fields) -> dict:
        """One request to the daemon; raises CacheUnavailableError on any transport failure."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: the parent's socket is not ours
                self._conn, self._maps, self._pid = None, {}, os.getpid()
            if self.degraded and time.monotonic() - self._degraded_since < RETRY_DAEMON_S:
                raise CacheUnavailableError("cache daemon unreachable (retrying later)")
            try:
                if self._conn is None:
                    self._conn = Connection(self.socket_path, self.tcp, self.timeout)
                reply = self._conn.request(op, **fields)
            except (OSError, ProtocolError, ValueError) as exc:
                self._drop_conn()
                self.counts["daemon_errors"] += 1
                where = f"tcp:{self.tcp}" if self.tcp else f"unix:{self.socket_path}"
                raise CacheUnavailableError(f"cache daemon at {where}: {type(exc).__name__}: {exc}") from exc
            if self.degraded:
                log.info("cache daemon reachable again; leaving origin fallback")
                self._degraded_since, self._warned = None, False
            return reply

    def _drop_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = None

    def _degrade(self, exc: Exception) -> None:
        if self._degraded_since is None or time.monotonic() - self._degraded_since >= RETRY_DAEMON_S:
            self._degraded_since = time.monotonic()
        if not self._warned:
            log.warning("%s; reading shards from origin %s until it is back", exc, self.root)
            self._warned = True

    def _origin_source(self) -> OriginSource:
        if self._origin is None:
            self._origin = OriginSource(self.root, self.index)
        return self._origin

    # -- ShardSource -----------------------------------------------------------
    def read_shard(self, name: str) -> memoryview:
        entry = self._check(name)
        with self._lock:
            view = self._maps.get(name)
            if view is not None and os.getpid() == self._pid:
                self._maps[name] = self._maps.pop(name)  # most recently used goes last
                return view
        with self._lock:  # make room first, so the daemon may evict what we no longer pin
            excess = list(self._maps)[:len(self._maps) - self.max_open + 1] if len(self._maps) >= self.max_open else []
        for old in excess:
            self.release(old)
        try:
            reply = self._request("get", shard=name, rank=self._rank)
        except CacheUnavailableError as exc:
            if not self.fallback:
                raise
            self._degrade(exc)
            return self._from_origin(name)
        except (ShardNotFoundError, IntegrityError, ValueError):
            raise  # the name or the origin's bytes are bad: origin would say the same
        except CacheError as exc:  # the daemon is up but could not fill (timeout, origin I/O error)
            if not self.fallback:
                raise
            log.warning("cache daemon could not serve %s (%s); reading it from origin", name, exc)
            return self._from_origin(name)
        if reply.get("tier") == "origin" or not reply.get("path"):
            return self._from_origin(name)  # the daemon could not place it (tiers pinned or disk full)
        try:
            view = _map(reply["path"], entry.bytes)
        except (OSError, IntegrityError) as exc:  # should not happen (the copy is pinned); never fatal
            if not self.fallback:
                raise CacheError(f"cache daemon handed out {reply['path']} but it is unusable: {exc}") from exc
            log.warning("cache tier file %s unusable (%s); reading %s from origin", reply["path"], exc, name)
            return self._from_origin(name)
        with self._lock:
            self._maps[name] = view
            self.counts["daemon_reads"] += 1
        return view

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        view = self.read_shard(name)
        if offset < 0 or length < 0 or offset + length > len(view):
            raise IntegrityError(f"{name}: range {offset}+{length} beyond {len(view)} bytes")
        return view[offset: offset + length]

    def _check(self, name: str):
        try:  # index.shard raises UnsafePathError for traversal before anything leaves the process
            return self.index.shard(name)
        except KeyError:
            raise ShardNotFoundError(f"shard {name!r} is not in the index of {self.root}") from None

    def _from_origin(self, name: str) -> memoryview:
        self.counts["origin_reads"] += 1
        return self._origin_source().read_shard(name)

    def announce(self, shards: list[str], *, rank: int, epoch: int) -> None:
        for s in shards:
            self._check(s)
        self._rank = rank
        try:
            self._request("announce", shards=list(shards), rank=rank, epoch=epoch)
        except CacheUnavailableError as exc:
            if not self.fallback:
                raise
            self._degrade(exc)

    def release(self, name: str) -> None:
        with self._lock:
            view = self._maps.pop(name, None)
        if view is not None:
            _close_view(view)
        try:
            self._request("release", shard=name)
        except CacheUnavailableError:
            pass  # the daemon is gone; so are its leases

    def stats(self) -> dict:
        try:
            daemon = self._request("stats")["stats"]
        except CacheError as exc:
            if not self.fallback:
                raise
            daemon = {"error": str(exc)}
        return {"client": {**self.counts, "degraded": self.degraded, "mapped": len(self._maps)}, "daemon": daemon}

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            self._drop_conn()
        for view in maps.values():
            _close_view(view)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_view(view: memoryview) -> None:
    """Unmap now if no slice of it is still alive; otherwise GC unmaps later."""
    obj = view.obj
    try:
        view.release()
        if isinstance(obj, mmap.mmap):
            obj.close()
    except BufferError:
        pass
