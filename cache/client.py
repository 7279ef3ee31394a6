"""CacheClient: a `ShardSource` that asks the node's cache daemon for a tier
file, opens it and reads it, once it has checked whose it is and its sha256. Cheap to construct in every
trainer worker (connects lazily, reconnects after fork). When the daemon is unreachable it falls back
to reading origin directly (unless fallback=False), and retries the daemon
after a backoff. No call blocks longer than `timeout` on the daemon.

Tier files are read with pread into private buffers, never mapped: a mapped file that its owner
truncates kills the reader with SIGBUS on the next touch, and a mapped file changed in place changes
bytes after they were checked. A pread of a truncated file is a short read (an error, served from
origin), and what a caller checks (the whole-shard sha256 here, a block's xxh3 in the reader) is the
very buffer it then decodes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import weakref

from loongforge.cache.access import (UntrustedPathError, connect, denied_message, file_problem, open_no_follow,
                                    resolve_user)
from loongforge.cache.config import DAEMON_USER_ENV, default_socket_path
from loongforge.cache.protocol import Connection, ProtocolError
from loongforge.shared import storage
from loongforge.shared.errors import CacheError, CacheUnavailableError, IntegrityError, ShardNotFoundError
from loongforge.shared.index import ShardEntry, ShardIndex
from loongforge.shared.source import OriginSource

log = logging.getLogger(__name__)
RETRY_DAEMON_S = 5.0  # while degraded, how often to try the daemon again
HASH_CHUNK = 1 << 20  # the sha256 of a new tier file is read in pieces this big
__all__ = ["CacheClient", "default_socket_path"]
_clients: "weakref.WeakSet[CacheClient]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The lease thread may hold a client's lock at the moment a DataLoader forks; the child has
    # no such thread, so it would wait on that lock forever. Children start with fresh locks.
    for client in list(_clients):
        client._lock = threading.RLock()
        client._forget_open_files()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_checked(path: str, entry: ShardEntry, owner_uid: int | None) -> int:
    """An fd of a tier file the daemon handed out, after checking it is the daemon's and holds the
    index's bytes: not a symlink, writable by no one but its owner, owned by the daemon's uid where
    the kernel told us (access.peer_uid), and its sha256 equal to the index's. The hash is checked
    on every new open, whatever the transport: the owner check cannot see a byte flipped in place by
    root or the daemon's uid, and a file checked once may have changed since. Read with pread, which
    cannot fault: a file truncated meanwhile is a short read, an IntegrityError."""
    fd = open_no_follow(path)
    try:
        problem = file_problem(os.fstat(fd), owner_uid, entry.bytes)
        if problem:
            raise IntegrityError(f"{path}: {problem}")
        h, buf = hashlib.sha256(), bytearray(min(HASH_CHUNK, max(entry.bytes, 1)))
        offset = 0
        while offset < entry.bytes:
            n = os.preadv(fd, [memoryview(buf)[:min(len(buf), entry.bytes - offset)]], offset)
            if n == 0:
                raise IntegrityError(f"{path}: ends at byte {offset}, index says {entry.bytes}: truncated under us")
            h.update(memoryview(buf)[:n])
            offset += n
        if h.hexdigest() != entry.sha256:
            raise IntegrityError(f"{path}: sha256 {h.hexdigest()[:16]}… != index {entry.sha256[:16]}…: changed")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread_exact(fd: int, length: int, offset: int, what: str) -> memoryview:
    """`length` bytes at `offset` in a private buffer; IntegrityError if the file ends before."""
    buf = bytearray(length)
    view, done = memoryview(buf), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise IntegrityError(f"{what}: ends before byte {offset + length} (at {offset + done}): truncated under us")
        done += n
    return memoryview(buf).toreadonly()


class CacheClient:
    def __init__(self, root: str, index: ShardIndex, *, socket_path: str | None = None, tcp: str | None = None,
                 fallback: bool = True, timeout: float = 5.0, max_open: int = 16, daemon_user: str | int | None = None):
        self.root = root
        self.index = index
        self.socket_path = socket_path or (None if tcp else default_socket_path())
        self.tcp = tcp
        # The uid the daemon must run as: daemon_user, else LOONGFORGE_CACHE_DAEMON_USER, else (None) the
        # socket directory's owner. A name that does not exist is a ConfigError now, not at the first read.
        self.daemon_uid = resolve_user(daemon_user if daemon_user is not None else os.environ.get(DAEMON_USER_ENV))
        self.fallback = fallback
        self.timeout = timeout
        self._origin: OriginSource | None = None
        self._conn: Connection | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        # Open tier files, oldest first; their leases are renewed while they stay open. Beyond
        # max_open the oldest is released: its pin goes and its fd is closed once no read uses it.
        self._files: dict[str, _TierFile] = {}
        self.requested_max_open = max_open
        self.max_open = max_open  # lowered to the daemon's `max_open` (from its RAM budget) on connect
        self._lease_s = 60.0
        self._peer_uid: int | None = None
        self._daemon_ops: set[str] = set()  # ops the daemon serves (hello): `report` only where listed
        self._renewer: tuple[int, threading.Event] | None = None  # (pid, stop) of the lease thread
        self._rank: int | None = None
        self._degraded_since: float | None = None
        self._warned = False
        self._corrupt_at_origin: dict[str, IntegrityError] = {}  # shards whose sha256 failed: ranges from origin
        self.counts = {"daemon_reads": 0, "origin_reads": 0, "daemon_errors": 0, "origin_range_reads": 0}
        _clients.add(self)

    @property
    def degraded(self) -> bool:
        return self._degraded_since is not None

    # -- daemon connection -----------------------------------------------------
    def _request(self, op: str, **fields) -> dict:
        """One request to the daemon; raises CacheUnavailableError on any transport failure."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: the parent's socket is not ours
                self._conn, self._pid = None, os.getpid()
                self._forget_open_files()
            if self.degraded and time.monotonic() - self._degraded_since < RETRY_DAEMON_S:
                raise CacheUnavailableError("cache daemon unreachable (retrying later)")
            try:
                if self._conn is None:
                    self._connect()
                reply = self._conn.request(op, **fields)
            except (OSError, ProtocolError, ValueError, CacheUnavailableError, UntrustedPathError) as exc:
                self._drop_conn()
                self.counts["daemon_errors"] += 1
                raise CacheUnavailableError(self._unreachable(exc)) from exc
            if self.degraded:
                log.info("cache daemon reachable again; leaving origin fallback")
                self._degraded_since, self._warned = None, False
            return reply

    def _connect(self) -> None:
        conn = connect(self.socket_path, self.tcp, self.timeout, self.daemon_uid)  # socket dir, then peer uid
        try:
            hello = conn.request("hello")
        except BaseException:
            conn.close()
            raise
        self._conn, self._peer_uid = conn, conn.peer_uid
        self._daemon_ops = set(hello.get("ops", ()))
        self._lease_s = float(hello.get("lease_s", self._lease_s))
        self.max_open = max(1, min(self.requested_max_open, int(hello.get("max_open", self.requested_max_open))))

    def _unreachable(self, exc: BaseException) -> str:
        where = f"tcp:{self.tcp}" if self.tcp else f"unix:{self.socket_path}"
        if isinstance(exc, PermissionError) and not self.tcp:
            return denied_message(self.socket_path)  # word for word what `loongforge cache stats|stop` print
        if isinstance(exc, UntrustedPathError):
            return str(exc)  # word for word what `loongforge cache stats|stop` print
        return f"cache daemon at {where}: {type(exc).__name__}: {exc}"

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
            # A permission problem or an untrusted socket directory never heals by itself: every read
            # bypasses the cache until an operator fixes the deployment, so say so loudly.
            denied = isinstance(exc.__cause__, (PermissionError, UntrustedPathError))
            log.log(logging.ERROR if denied else logging.WARNING, "%s; reading shards from origin %s %s", exc,
                    self.root, "instead (the cache is bypassed)" if denied else "until it is back")
            self._warned = True

    def _origin_source(self) -> OriginSource:
        if self._origin is None:
            self._origin = OriginSource(self.root, self.index)
        return self._origin

    # -- ShardSource -----------------------------------------------------------
    def read_shard(self, name: str) -> memoryview:
        """The whole shard in a private buffer whose sha256 was checked (the buffer returned, not the
        file, which may change after the check)."""
        entry = self._check(name)
        tier_file = self._tier_file(name, entry)
        if tier_file is not None:
            try:
                data = _pread_exact(tier_file.fd, entry.bytes, 0, name)
                storage.verify(data, name, entry.bytes, entry.sha256)
                return data
            except (OSError, IntegrityError) as exc:
                self._lost(name, exc)
            finally:
                self._done(tier_file)
        return self._from_origin(name)

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        """A private copy of the range (pread): the caller's xxh3 check and its decode see the same bytes."""
        if name in self._corrupt_at_origin:
            return self._origin_range(name, offset, length)
        entry = self._check(name)
        if offset < 0 or length < 0 or offset + length > entry.bytes:
            raise IntegrityError(f"{name}: range {offset}+{length} beyond {entry.bytes} bytes")
        try:
            tier_file = self._tier_file(name, entry)
            if tier_file is None:
                return self._from_origin(name)[offset: offset + length]
        except IntegrityError as exc:
            # The whole-shard sha256 failed (daemon fill or direct origin read): neither would ever serve this
            # shard, so read its members individually from the origin, each checked against its own checksum
            # (a block's or an episode's arrays' xxh3 in the manifest); only the ranges whose bytes are corrupt
            # fail (the bad-sample policy), not the whole shard.
            if not self.fallback:  # fallback=False: never read the origin behind the daemon's back
                raise
            log.warning("%s; reading its blocks one by one from origin %s, each checked against its xxh3 "
                        "(only the corrupt ones fail)", exc, self.root)
            self._corrupt_at_origin[name] = exc
            return self._origin_range(name, offset, length)
        try:
            return _pread_exact(tier_file.fd, length, offset, name)
        except (OSError, IntegrityError) as exc:
            self._lost(name, exc)
        finally:
            self._done(tier_file)
        return self._from_origin(name)[offset: offset + length]

    def _tier_file(self, name: str, entry: ShardEntry) -> "_TierFile | None":
        """The open, checked tier file of `name` (a reference: hand it back with _done), asking the
        daemon for it if this process has none open; None where origin must serve the read."""
        with self._lock:
            if os.getpid() != self._pid:
                self._forget_open_files()
            tier_file = self._files.get(name)
            if tier_file is not None:
                self._files[name] = self._files.pop(name)  # most recently used goes last
                tier_file.users += 1
                return tier_file
            # make room first, so the daemon may evict what we no longer pin
            excess = list(self._files)[:len(self._files) - self.max_open + 1] if len(self._files) >= self.max_open else []
        for old in excess:
            self.release(old)
        try:
            reply = self._request("get", shard=name, rank=self._rank)
        except CacheUnavailableError as exc:
            if not self.fallback:
                raise
            self._degrade(exc)
            return None
        except (ShardNotFoundError, IntegrityError, ValueError):
            raise  # the name or the origin's bytes are bad: origin would say the same
        except CacheError as exc:  # the daemon is up but could not fill (timeout, origin I/O error)
            if not self.fallback:
                raise
            log.warning("cache daemon could not serve %s (%s); reading it from origin", name, exc)
            return None
        if reply.get("tier") == "origin" or not reply.get("path"):
            return None  # the daemon could not place it (tiers pinned or disk full)
        fd = self._open_or_report(name, entry, reply["path"])
        if fd is None:
            return None
        with self._lock:
            tier_file = self._files.get(name)
            if tier_file is None:  # another thread may have opened it meanwhile: keep one
                tier_file = self._files[name] = _TierFile(fd)
                self.counts["daemon_reads"] += 1
                self._ensure_renewer()
            else:
                os.close(fd)
            tier_file.users += 1
        return tier_file

    def _done(self, tier_file: "_TierFile") -> None:
        with self._lock:
            tier_file.users -= 1
            tier_file.close_if_unused()

    def _lost(self, name: str, exc: BaseException) -> None:
        """A tier file failed a read after it passed its check (truncated, an I/O error): it goes, the
        daemon is told (it checks its copy and fills the shard again), and this read is origin's."""
        log.warning("cache tier file of %s failed a read after it was checked (%s: %s); reported to the daemon, "
                    "reading it from origin", name, type(exc).__name__, exc)
        self._report(name, exc)
        self.release(name)

    def _open_or_report(self, name: str, entry: ShardEntry, path) -> int | None:
        """Open the tier file the daemon handed out. A file this client refuses is reported: the daemon
        checks it itself and, if it agrees, drops it and hands out a fresh copy, opened instead (so
        one bad file costs a refill, not an origin read per reader until eviction). None: read origin."""
        try:
            return _open_checked(path, entry, self._peer_uid)
        except Exception as exc:  # noqa: BLE001 - whatever a daemon hands out must never end the reader
            refused = exc
        fresh = self._report(name, refused)
        if fresh is not None:
            try:
                fd = _open_checked(fresh["path"], entry, self._peer_uid)
            except Exception as exc:  # noqa: BLE001 - as above
                refused = exc
            else:
                log.warning("cache tier file %s refused (%s); reported: the daemon found it bad too (%s) and "
                            "handed out a fresh copy", path, refused, fresh.get("problems"))
                return fd
        if not self.fallback:
            raise CacheError(f"cache daemon handed out {path} but it is unusable: {refused}") from refused
        log.warning("cache tier file %s unusable (%s); reading %s from origin", path, refused, name)
        return None

    def _report(self, name: str, exc: BaseException) -> dict | None:
        """Tell the daemon that its file for `name` was refused, and why. Its reply if it found the file
        bad and put a fresh copy in a tier; None otherwise (intact by its check, or no daemon)."""
        if "report" not in self._daemon_ops:
            return None  # a daemon older than `report` would answer `unknown op`
        try:
            reply = self._request("report", shard=name, reason=f"{type(exc).__name__}: {exc}")
        except CacheError:
            return None
        return reply if reply.get("replaced") and reply.get("path") else None

    def _ensure_renewer(self) -> None:
        """One lease thread per process (a forked worker starts its own): without renewal a lease
        lapses after lease_s, the daemon evicts a shard we still map, and the RAM tier's real memory
        exceeds its budget by every such map."""
        if self._renewer is not None and self._renewer[0] == os.getpid():
            return
        stop = threading.Event()
        self._renewer = (os.getpid(), stop)
        threading.Thread(target=self._renew_loop, args=(stop,), daemon=True, name="cache-lease-renew").start()

    def _renew_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self._lease_s / 3):
            with self._lock:
                names = list(self._files)
            if names:
                try:
                    self._request("renew", shards=names)
                except CacheError:
                    pass  # daemon gone or degraded: its leases went with it; reads reconnect

    def _origin_range(self, name: str, offset: int, length: int) -> memoryview:
        """A range of a shard whose whole-file hash failed, from the origin; the dataset reader checks it against
        the manifest's per-block (or per-episode arrays) xxh3 before any byte is decoded."""
        self.counts["origin_range_reads"] += 1
        return self._origin_source().read_range(name, offset, length)

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
            tier_file = self._files.pop(name, None)
            if tier_file is not None:
                tier_file.retire()
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
        return {"client": {**self.counts, "degraded": self.degraded, "open": len(self._files)}, "daemon": daemon}

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
            if self._renewer is not None:
                self._renewer[1].set()
                self._renewer = None
            self._drop_conn()
            for tier_file in files.values():
                tier_file.retire()

    def _forget_open_files(self) -> None:
        """In a forked child: the parent's fds are copies here, its pins are not ours; start afresh."""
        files, self._files = self._files, {}
        for tier_file in files.values():
            tier_file.users = 0
            tier_file.retire()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _TierFile:
    """An open, checked tier file. Readers hold a reference while they pread (under the client's lock),
    so that release() or close() in another thread closes the fd only once no read uses it: a closed
    fd's number is reused by the next open, and a pread on it would read another file."""

    __slots__ = ("fd", "users", "retired")

    def __init__(self, fd: int):
        self.fd, self.users, self.retired = fd, 0, False

    def retire(self) -> None:
        self.retired = True
        self.close_if_unused()

    def close_if_unused(self) -> None:
        if self.retired and self.users <= 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
