"""Node-to-node shard transfer: a tiny HTTP server that serves this node's
verified tier files to the other nodes of the deployment, and the fetch that
reads them. This is what lets a node that lost the single-flight race get a
shard without touching origin.

GET /shard/<name> -> 200 with the bytes (from RAM, else SSD), 404 if this
node no longer holds it, 400 for names outside the index, 401 without a valid
signature. The receiver verifies size and sha256 against its own index, so a
peer is never trusted for the bytes.

Who may read: the holders of the deployment's shared secret (every node has
the same one: a key file, or LOONGFORGE_CACHE_PEER_SECRET). Each request is
signed with HMAC-SHA256 over the method, path, the node it is for (the
address that node advertises), a timestamp and a random nonce;
the server refuses a timestamp more than `peer_auth_window_s` from its clock
and a nonce it has seen within that window (a replay), each with 401 and a
count in `peer_refused{reason}`. Nonces are remembered per node, so the
target is what stops a request captured on its way to one node from being
replayed to another: signed for another address, it is a bad signature. A shared secret rather than mutual TLS: every
node already gets its Redis credentials the same way, there is no certificate
authority to run, and the bytes need no secrecy from the network the nodes
share (the secret authenticates; it does not encrypt: see cache/README.md,
Security).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import logging
import os
import secrets
import shutil
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

from loongforge.cache.serving import BoundedServer, TimeoutHandler
from loongforge.shared.errors import CacheError, ConfigError

log = logging.getLogger(__name__)
SCHEME = "LoongForge-HMAC-SHA256"
MIN_SECRET = 32  # bytes
MIN_SECRET_BITS = 80  # secret_bits(): a random 32-character hex key (128 bits) scores >= 90
MAX_NONCES = 1 << 20  # a replay cache bigger than this means a flood: refuse until entries expire


def load_secret(cfg) -> bytes | None:
    """The deployment's peer secret from `peer_secret_file` (a regular file of the daemon's uid or
    root, readable by no one else: it lets its holder read every shard) or `peer_secret`; None if
    neither is set. ConfigError, naming the fix, for anything weaker."""
    if cfg.peer_secret_file:
        path = cfg.peer_secret_file
        try:  # symlinks are followed: Kubernetes mounts a Secret's keys as links into ..data/
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                secret = f.read(1 << 16).strip()
        except OSError as exc:
            raise ConfigError(f"peer_secret_file {path}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
            raise ConfigError(
                f"peer_secret_file {path} ({stat.filemode(st.st_mode)}, owner uid {st.st_uid}) must be a file of the "
                f"daemon's user readable by no one else: whoever reads it can read every shard over the peer port. "
                f"chown it to the daemon's user and chmod 600 (Kubernetes: defaultMode 0400)")
    elif cfg.peer_secret:
        secret, path = cfg.peer_secret.encode(), "peer_secret (LOONGFORGE_CACHE_PEER_SECRET or the config file)"
    else:
        return None
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"peer secret from {path}: {len(secret)} bytes, at least {MIN_SECRET} are needed "
                          "(`openssl rand -hex 32`)")
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS:
        raise ConfigError(f"peer secret from {path}: about {bits:.0f} bits of entropy (repeated or few distinct "
                          f"characters), at least {MIN_SECRET_BITS} are needed: a placeholder or a pattern is guessed "
                          "before a random key. Generate one: `openssl rand -hex 32`")
    return secret


def secret_bits(secret: bytes) -> float:
    """A floor on a secret's entropy, to refuse placeholders and patterns (32 x `a`, a word repeated):
    the length of its shortest repeating unit times the Shannon entropy of that unit's byte counts.
    `openssl rand -hex 32` scores ~240, 32 random hex characters >= 90 (their counts are uneven); it sees no
    dictionary words, so it is a floor, not a proof."""
    unit = secret
    for period in range(1, len(secret) // 2 + 1):
        if len(secret) % period == 0 and secret[:period] * (len(secret) // period) == secret:
            unit = secret[:period]
            break
    counts = collections.Counter(unit)
    return -sum(n * math.log2(n / len(unit)) for n in counts.values())


def sign(secret: bytes, method: str, path: str, target: str, now: float | None = None,
         nonce: str | None = None) -> dict:
    """The headers that authenticate one request to the node advertising `target` (HOST:PORT)."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(16)
    return {"X-LoongForge-Time": ts, "X-LoongForge-Nonce": nonce,
            "Authorization": f"{SCHEME} {_mac(secret, method, path, target, ts, nonce)}"}


def _mac(secret: bytes, method: str, path: str, target: str, ts: str, nonce: str) -> str:
    # /2: the target joined the signed string (a /1 node's requests fail here as bad signatures)
    message = "\n".join(("loongforge-cache-peer/2", method, target, path, ts, nonce)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class _Guard:
    """Checks signatures; remembers each nonce for the window, so a captured request cannot be
    replayed (an older timestamp is refused as stale, a newer one was never signed)."""

    def __init__(self, secret: bytes, window_s: float, target: str):
        self.secret, self.window_s, self.target = secret, window_s, target
        self.nonces: dict[str, float] = {}  # nonce -> when it may be forgotten
        self.lock = threading.Lock()

    def refusal(self, method: str, path: str, headers) -> str | None:
        """None if the request is signed by a holder of the secret, else the reason (a counter label)."""
        ts, nonce, auth = (headers.get(h) for h in ("X-LoongForge-Time", "X-LoongForge-Nonce", "Authorization"))
        if not (ts and nonce and auth):
            return "unsigned"
        scheme, _, mac = auth.partition(" ")
        if scheme != SCHEME or not ts.isdigit() or not 16 <= len(nonce) <= 64:
            return "malformed"
        if not hmac.compare_digest(mac.encode(), _mac(self.secret, method, path, self.target, ts, nonce).encode()):
            return "bad_signature"
        now = time.time()
        if abs(now - int(ts)) > self.window_s:
            return "stale"
        with self.lock:
            if nonce in self.nonces:
                return "replayed"
            if len(self.nonces) >= MAX_NONCES:
                self.nonces = {n: t for n, t in self.nonces.items() if t > now}
                if len(self.nonces) >= MAX_NONCES:
                    return "flooded"
            self.nonces[nonce] = now + 2 * self.window_s
        return None


class _Handler(TimeoutHandler, BaseHTTPRequestHandler):
    server_version = "loongforge-cache-peer/1"

    def do_GET(self):  # noqa: N802 - http.server naming
        refusal = self.server.guard.refusal("GET", self.path, self.headers)
        if refusal:
            self._refuse(refusal)
            return
        store = self.server.store
        prefix = "/shard/"
        if not self.path.startswith(prefix):
            self.send_error(404)
            return
        name = urllib.parse.unquote(self.path[len(prefix):])
        try:
            store.entry(name)
        except (ValueError, KeyError):
            self.send_error(400, "not a shard of this index")
            return
        f = _open_held(store, name)
        if f is None:
            self.send_error(404, "not held here")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/x-tar")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _refuse(self, reason: str) -> None:
        self.server.store.metrics.inc("peer_refused", reason)
        first = reason not in self.server.warned  # one WARNING per reason, then DEBUG: a scan must not flood the log
        self.server.warned.add(reason)
        log.log(logging.WARNING if first else logging.DEBUG,
                "peer port: refused %s %s from %s (%s): not signed with this deployment's peer secret%s",
                self.command, self.path[:200], self.client_address[0], reason,
                "; later refusals are counted in peer_refused{reason}" if first else "")
        self.send_response(401)
        self.send_header("WWW-Authenticate", SCHEME)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, fmt, *args):
        log.debug("peer %s: " + fmt, self.client_address[0], *args)


def _open_held(store, name: str, pending_wait_s: float = 5.0):
    """An open file of `name` from RAM, else SSD; None if this node does not
    hold it. A shard whose RAM copy was evicted while its SSD write-through is
    still pending counts as held: wait (bounded) for the write to end."""
    deadline = time.monotonic() + pending_wait_s
    with store.lock:
        while True:
            for tier in (store.ram, store.ssd):
                if name in tier:
                    try:
                        return open(tier.path(name), "rb")  # an open fd survives a later unlink
                    except FileNotFoundError:
                        continue
            remaining = deadline - time.monotonic()
            if name not in store.ssd.reserved or remaining <= 0:
                return None
            store.write_done.wait(remaining)


class _PeerHTTPServer(BoundedServer, HTTPServer):
    name = "peer port"
    # A node's fetches from one holder at once: its readers' and prefetchers' concurrent fills. The
    # bound keeps idle connections from one address (400 were held in the audit) from taking every thread.
    max_per_peer = 64


class PeerServer:
    def __init__(self, store, host: str, port: int, secret: bytes, window_s: float, advertise: str | None = None,
                 metrics=None, read_timeout_s: float = 10.0):
        self.httpd = _PeerHTTPServer((host, port), _Handler)
        self.httpd.metrics, self.httpd.read_timeout_s = metrics, read_timeout_s
        self.httpd.store = store
        # The address the other nodes are told (Redis directory) and sign their requests for.
        self.target = advertise or f"{host}:{self.port}"
        self.httpd.guard = _Guard(secret, window_s, self.target)
        self.httpd.warned = set()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="peer-server")

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> "PeerServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fetch_from_peer(addr: str, name: str, timeout: float, secret: bytes | None) -> bytes:
    path = f"/shard/{urllib.parse.quote(name)}"
    headers = sign(secret, "GET", path, addr) if secret else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{addr}{path}", headers=headers),
                                    timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        hint = (": this node's peer secret is not the deployment's (or it has none, or the clocks differ by more "
                "than peer_auth_window_s)") if exc.code == 401 else ""
        raise CacheError(f"peer {addr}: HTTP {exc.code} {exc.reason}{hint}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise CacheError(f"peer {addr}: {exc}") from exc
