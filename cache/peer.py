"""Node-to-node shard transfer: a tiny HTTP server that serves this node's
verified tier files, and the fetch that reads them. This is what lets a node
that lost the single-flight race get a shard without touching origin.

GET /shard/<name> -> 200 with the bytes (from RAM, else SSD), 404 if this
node no longer holds it, 400 for names outside the index. The receiver
verifies size and sha256 against its own index, so a peer is never trusted.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from loongforge.shared.errors import CacheError

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server_version = "loongforge-cache-peer/1"

    def do_GET(self):  # noqa: N802 - http.server naming
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


class PeerServer:
    def __init__(self, store, host: str, port: int):
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.store = store
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


def fetch_from_peer(addr: str, name: str, timeout: float) -> bytes:
    url = f"http://{addr}/shard/{urllib.parse.quote(name)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise CacheError(f"peer {addr}: {exc}") from exc
