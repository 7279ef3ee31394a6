"""The cache daemon process: socket server, background threads, shutdown.

Threads: one per client connection (blocking I/O, daemon threads), N
prefetchers, one heartbeat/reaper, optional peer and metrics HTTP servers.
SIGTERM/SIGINT and the `stop` op shut down cleanly: socket removed, RAM tier
files removed, SSD tier kept, node deregistered from Redis.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import signal
import socket
import socketserver
import stat
import threading
import time

from loongforge.cache import protocol
from loongforge.cache.access import SOCKET_MODE, check_socket_dir, make_dirs, make_private_dir, peer_uid
from loongforge.cache.config import CacheConfig, fallback_socket_dir, parse_hostport
from loongforge.cache.coord import Coordinator
from loongforge.cache.metrics import Metrics, serve_metrics
from loongforge.cache.peer import PeerServer
from loongforge.cache.serving import BoundedServer
from loongforge.cache.store import Store
from loongforge.shared.errors import CacheError, ConfigError, LoongForgeError
from loongforge.shared.dataset import load_shard_index

log = logging.getLogger(__name__)
_owner_ids = itertools.count(1)
REASON_CHARS = 500  # a report's reason is the client's words: logged, so bounded
MAX_INT = 2**31 - 1  # ranks and epochs


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        daemon: Daemon = self.server.cache_daemon
        owner = f"c{next(_owner_ids)}"
        timeout = self.server.read_timeout_s
        lines = _LineReader(self.request, timeout)
        try:
            while True:
                line = lines.next()
                if line is None:
                    return
                reply = daemon.dispatch(line, owner, lambda: peer_uid(self.request))
                self.request.settimeout(timeout)  # a client that reads no replies is dropped too
                self.request.sendall(protocol.encode(reply))
                if reply.get("stopping"):  # only after the reply is out: the process exits soon after
                    threading.Thread(target=daemon.shutdown, daemon=True).start()
                    return
                if len(line) > protocol.MAX_LINE:
                    return  # the rest of an oversized line is garbage: drop the connection
        except TimeoutError:
            self.server.note("timeout", f"uid {peer_uid(self.request)}: a request not whole within {timeout:g} s "
                                        "(or a reply not taken)")
        except ConnectionError:
            pass
        finally:
            daemon.store.release_owner(owner)


class _LineReader:
    """Request lines off a connection. Waiting for a request has no time limit (trainers keep one
    connection for their lifetime and may be idle for minutes); a request once begun must arrive
    whole within `timeout` seconds, or TimeoutError: a silent partial request held a thread and an
    fd for as long as its sender liked."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock, self.timeout, self.buf, self.scanned = sock, timeout, bytearray(), 0

    def next(self) -> bytes | None:
        """The next line (with its newline), a longer-than-allowed or final unterminated one as it
        stands, or None at the end of the connection."""
        deadline = time.monotonic() + self.timeout if self.buf else None
        while True:
            end = self.buf.find(b"\n", self.scanned)
            if end >= 0 or len(self.buf) > protocol.MAX_LINE:
                end = end + 1 if end >= 0 else len(self.buf)
                line = bytes(self.buf[:end])
                del self.buf[:end]
                self.scanned = 0
                return line
            self.scanned = len(self.buf)
            if deadline is None:
                self.sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"request not whole within {self.timeout:g} s")
                self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                line, self.buf = bytes(self.buf), bytearray()
                return line or None
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            self.buf += chunk


class _UnixServer(BoundedServer, socketserver.UnixStreamServer):
    name = "socket"
    max_per_peer = 1024  # per uid: every worker of every rank of a trainer user, with room

    def peer_of(self, request, client_address):
        return peer_uid(request)

    def server_bind(self):
        # Trainers connect as members of the daemon's group: the socket must be 0660 whatever the
        # umask (0755 under 022 refuses them). Bind under umask 077 so the path is never open to
        # others, then widen to the group. Safe to touch the process umask: no other thread exists yet.
        old = os.umask(0o077)
        try:
            super().server_bind()
        finally:
            os.umask(old)
        os.chmod(self.server_address, SOCKET_MODE)


class _TCPServer(BoundedServer, socketserver.TCPServer):
    name = "socket"
    max_per_peer = 1024
    allow_reuse_address = True

    def peer_of(self, request, client_address):
        return peer_uid(request)  # loopback only: the address says nothing, the uid does


class _TCP6Server(_TCPServer):
    address_family = socket.AF_INET6


class Daemon:
    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.index = load_shard_index(cfg.origin)  # the shard list of the root (FORMAT.md)
        namespace = hashlib.sha256(self.index.to_json()).hexdigest()[:16]  # one key space per dataset
        self.metrics = Metrics(cfg.node_id)
        self.store = Store(cfg, self.index, self.metrics,
                           lambda holdings: Coordinator(cfg, namespace, self.metrics, holdings))
        self.coord = self.store.coord
        self.stop_event = threading.Event()
        self.started = time.time()
        self.server = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we published
        self.peer = None
        self.metrics_server = None

    # -- requests --------------------------------------------------------------
    def dispatch(self, line: bytes, owner: str, client_uid=lambda: None) -> dict:
        """One request -> one reply, whatever the bytes: a malformed message is an error reply,
        never a crashed handler. `client_uid()`: the uid at the other end (asked for `stop` only)."""
        req_id = None
        try:
            req = protocol.decode(line)
            req_id = req.get("id")
            if req.get("v") != protocol.PROTOCOL_VERSION:
                raise protocol.ProtocolError(
                    f"protocol version {req.get('v')!r}, daemon speaks {protocol.PROTOCOL_VERSION}: upgrade the client")
            op = req.get("op")
            if not isinstance(op, str) or op not in protocol.OPS:
                raise protocol.ProtocolError(f"unknown op {op!r}; ops: {', '.join(protocol.OPS)}")
            if op == "stop":
                self._authorize_stop(client_uid())
            result = getattr(self, "op_" + op)(req, owner)
            return {"v": protocol.PROTOCOL_VERSION, "id": req_id, "ok": True, **result}
        except (LoongForgeError, ValueError, KeyError, TypeError, OSError) as exc:
            if not isinstance(exc, LoongForgeError):
                log.warning("request failed: %s: %s", type(exc).__name__, exc)
            return protocol.error_reply(req_id, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: say so with its traceback, keep serving
            log.error("request failed unexpectedly (a bug; the daemon keeps serving): %s: %s",
                      type(exc).__name__, exc, exc_info=True)
            return protocol.error_reply(req_id, exc)

    def _authorize_stop(self, uid: int | None) -> None:
        """`stop` is for the daemon's own uid and root (the operator: `loongforge cache stop` as that
        user, or systemctl / SIGTERM); the group's trainers may use the cache, not end it for everyone."""
        if uid in (0, os.geteuid()):
            return
        self.metrics.inc("rejected", "stop_not_allowed")
        who = "a process whose uid cannot be told" if uid is None else f"uid {uid}"
        log.warning("refused `stop` from %s: only uid %d (the daemon's) or root may stop it", who, os.geteuid())
        raise CacheError(f"stop refused: only the daemon's user (uid {os.geteuid()}) or root may stop the cache "
                         f"daemon, and this request came from {who}. Ask its operator (systemctl stop "
                         f"loongforge-cache, or `loongforge cache stop` as that user)")

    def op_hello(self, req, owner):
        return {"node": self.cfg.node_id, "protocol": protocol.PROTOCOL_VERSION, "ops": list(protocol.OPS),
                "origin": self.cfg.origin, "shards": len(self.index.shards), "ram_budget": self.cfg.ram_budget,
                "max_open": self.store.max_open(), "lease_s": self.cfg.lease_s}

    def op_get(self, req, owner):
        return self.store.get(_str(req, "shard"), owner, _int(req, "rank", optional=True))

    def op_report(self, req, owner):
        reason = _str(req, "reason", why="why the client refused the file")
        return self.store.report(_str(req, "shard"), owner, reason[:REASON_CHARS])

    def op_renew(self, req, owner):
        return {"renewed": self.store.renew(_names(req, "shards"), owner), "lease_s": self.cfg.lease_s}

    def op_release(self, req, owner):
        self.store.release(_str(req, "shard"), owner)
        return {}

    def op_announce(self, req, owner):
        n = self.store.announce(_int(req, "rank"), _int(req, "epoch"), _names(req, "shards"))
        return {"announced": n}

    def op_stats(self, req, owner):
        return {"stats": self.stats()}

    def op_stop(self, req, owner):
        return {"stopping": True}  # the handler shuts down once this reply is sent

    def stats(self) -> dict:
        # Store state first, counters second: work is counted before it leaves the store's queues, so a
        # reply that says `ssd_pending: 0` also counts every write-through that finished (read in the
        # other order, a write could finish in between and be missing from the counters).
        store = self.store.snapshot()
        counters = self.metrics.snapshot()
        return {"node": self.cfg.node_id, "endpoint": self.cfg.endpoint, "origin": self.cfg.origin,
                "uptime_s": round(time.time() - self.started, 3), "redis": self.coord.snapshot(),
                "counters": counters, **store}

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        # Bind first: a second daemon on the same endpoint fails before it touches any tier, and the
        # socket is created while this is the only thread (see _UnixServer.server_bind). A unix
        # socket is bound under a private name and linked to its path only once the daemon listens
        # and is ready, so "the socket exists" keeps meaning "the daemon serves" (clients and
        # scripts rely on it; a client that connects earlier is refused at once and reads origin).
        self.server = self._bind()
        try:
            self._start_services()
            self.server.server_activate()
            if not self.cfg.tcp:
                self._socket_id = _publish_socket(self.server.server_address, self.cfg.socket)
        except BaseException:
            self.server.server_close()
            _unlink_if_socket(self.server.server_address) if not self.cfg.tcp else None
            self.store.close()  # the RAM tier it may have made: a refused start leaves nothing in /dev/shm
            raise

    def _start_services(self) -> None:
        self.store.open()
        if self.cfg.peer_listen:
            host, port = parse_hostport(self.cfg.peer_listen, "peer_listen")
            with _listening("peer_listen", self.cfg.peer_listen):
                self.peer = PeerServer(self.store, host, port, self.store.peer_secret, self.cfg.peer_auth_window_s,
                                       self.cfg.peer_advertise, self.metrics, self.cfg.read_timeout_s).start()
            self.coord.peer_addr = self.peer.target
        elif self.cfg.redis_url:
            log.warning("redis is configured but --peer-listen is not: nodes cannot copy shards from each other, "
                        "so each node still reads every shard it misses from origin (one at a time)")
        if self.cfg.metrics_port is not None:
            with _listening("metrics_port", f"{self.cfg.metrics_host}:{self.cfg.metrics_port}"):
                self.metrics_server = serve_metrics(self.metrics, self.cfg.metrics_host, self.cfg.metrics_port,
                                                    self.cfg.read_timeout_s)
            log.info("metrics on http://%s:%d/metrics", self.cfg.metrics_host, self.metrics_server.server_port)
        self.coord.heartbeat()
        threads = [threading.Thread(target=self.store.prefetch_loop, args=(self.stop_event,), daemon=True,
                                    name=f"prefetch-{i}") for i in range(self.cfg.prefetch_threads)]
        threads.append(threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat"))
        for t in threads:
            t.start()

    def _bind(self):
        if self.cfg.tcp:
            family, addr = protocol.parse_endpoint(None, self.cfg.tcp)
            server = (_TCP6Server if family == socket.AF_INET6 else _TCPServer)(addr, _Handler, False)
            server.server_bind()
        else:
            path = self.cfg.socket
            parent = os.path.dirname(os.path.abspath(path))
            if parent == fallback_socket_dir():
                make_private_dir(parent)
            else:
                check_socket_dir(path, os.geteuid())  # nothing is created inside another user's directory
                make_dirs(parent)  # what it creates is 0750 whatever the umask: group members reach the socket
            check_socket_dir(path, os.geteuid())  # the check every client makes: refuse now what no client would trust
            _clear_stale_socket(path)
            server = _UnixServer(f"{path}.{os.getpid()}.starting", _Handler, False)
            server.server_bind()
        server.cache_daemon, server.metrics, server.read_timeout_s = self, self.metrics, self.cfg.read_timeout_s
        return server

    def _unlink_socket(self) -> None:
        """Remove our socket, and only ours: whatever now sits at the path (another user's socket in a
        directory we should never have been given, a new daemon's) is left alone with a WARNING."""
        if self.cfg.tcp or self._socket_id is None:
            return  # nothing published (TCP, or stopped before the socket got its name)
        path = self.cfg.socket
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != self._socket_id:
            log.warning("%s is no longer the socket this daemon published (%s, owner uid %d): left in place",
                        path, stat.filemode(st.st_mode), st.st_uid)
            return
        os.unlink(path)

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(self.cfg.heartbeat_s):
            self.coord.heartbeat()
            with self.store.lock:
                self.store.pinned()  # reap expired leases
            self.store.wake.set()  # re-plan prefetch periodically (e.g. after a failed fill)

    def serve_forever(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=self.shutdown, daemon=True).start())
        host, port = self.server.server_address[:2] if self.cfg.tcp else (None, None)
        where = self.cfg.endpoint if not self.cfg.tcp else f"tcp:[{host}]:{port}" if ":" in host else \
            f"tcp:{host}:{port}"
        line = f"cache daemon ready on {where} (node {self.cfg.node_id}, redis {self.coord.state}" + \
               (f", peer {self.coord.peer_addr}" if self.peer else "") + ")"
        log.info(line)
        print(line, flush=True)
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self._cleanup()

    def shutdown(self) -> None:
        if not self.stop_event.is_set():
            self.stop_event.set()
            self.server.shutdown()

    def _cleanup(self) -> None:
        """Every step runs, whatever an earlier one raised: a socket we may not unlink must not leave
        the RAM tier (a /dev/shm segment) behind."""
        steps = [("closing the server", self.server.server_close), ("removing the socket", self._unlink_socket),
                 ("stopping the peer server", self.peer.stop if self.peer else None),
                 ("stopping the metrics server", self.metrics_server.shutdown if self.metrics_server else None),
                 ("deregistering from redis", self.coord.deregister), ("removing the RAM tier", self.store.close)]
        failed = []
        for what, step in steps:
            if step is None:
                continue
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - one failed step must not skip the others
                failed.append(what)
                log.error("stopping: %s failed (%s: %s); going on with the rest", what, type(exc).__name__, exc)
        log.info("cache daemon stopped: socket and RAM tier removed, SSD tier kept at %s%s", self.cfg.ssd_dir,
                 f" (except: {', '.join(failed)})" if failed else "")


@contextlib.contextmanager
def _listening(field: str, where: str):
    """A port the OS refuses (in use, an address not on this host, a privileged port) is one line."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"{field} {where}: cannot listen there: {exc.strerror or exc}") from None


def _str(req: dict, name: str, why: str = "a shard name") -> str:
    value = req.get(name)
    if not isinstance(value, str):
        raise protocol.ProtocolError(f"{req.get('op')}: {name} must be a string ({why}), got {_kind(value)}")
    return value


def _int(req: dict, name: str, optional: bool = False) -> int | None:
    """A rank or epoch: an integer in [0, 2**31); floats, booleans and huge numbers are refused
    (int(1e400) raised OverflowError inside the handler)."""
    value = req.get(name)
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise protocol.ProtocolError(f"{req.get('op')}: {name} must be an integer from 0 to {MAX_INT}, "
                                     f"got {_kind(value)}")
    return value


def _names(req: dict, name: str) -> list[str]:
    value = req.get(name)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise protocol.ProtocolError(f"{req.get('op')}: {name} must be a list of shard names")
    return value


def _kind(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:40]}…"


def _clear_stale_socket(path: str) -> None:
    """Remove the socket a dead daemon of this user left behind; refuse anything else at `path`
    (a regular file, someone else's socket, a live daemon): unlinking it would be data loss or a
    takeover of another user's endpoint."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise CacheError(f"{path} exists and is not a socket of uid {os.geteuid()} ({stat.filemode(st.st_mode)}, "
                         f"owner uid {st.st_uid}): refusing to replace it; remove it if it is yours, or pass --socket")
    probe = socket.socket(socket.AF_UNIX)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: the socket of a dead daemon
        return
    except OSError as exc:
        raise CacheError(f"{path}: cannot tell whether a daemon serves it ({exc}); remove it or pass --socket") from exc
    finally:
        probe.close()
    raise CacheError(f"another cache daemon is serving on {path}; stop it (`loongforge cache stop`) or pass --socket")


def _publish_socket(bound: str, path: str) -> tuple[int, int]:
    """Give the listening socket its public name; returns its (st_dev, st_ino), which cleanup checks
    before unlinking. link() fails if the name was taken since the stale check (a daemon started
    meanwhile): never replace another daemon's socket."""
    try:
        os.link(bound, path)
        st = os.lstat(bound)
    except FileExistsError:
        raise CacheError(f"{path} appeared while this daemon started (another daemon?); "
                         "stop it (`loongforge cache stop`) or pass --socket") from None
    finally:
        _unlink_if_socket(bound)
    return st.st_dev, st.st_ino


def _unlink_if_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
