"""How the daemon's three servers (its socket, the peer port, the metrics port) take connections: a
listen backlog sized for a node's trainer workers connecting at once, a bound on the connections one
peer holds (a uid on the socket, an address on the ports), and connection errors (a peer that resets,
times out or goes over its bound) counted and logged once per reason, never a traceback per event.
Each server also reads with a timeout (`read_timeout_s`, the config's): the socket's handler for a
request once begun, the HTTP handlers for the whole request (TimeoutHandler).
"""

from __future__ import annotations

import logging
import socketserver
import sys
import threading

log = logging.getLogger(__name__)
# At start every decode worker of every rank connects at once (8 GPUs x several workers): with the
# socketserver default of 5, 15 of 32 connects failed with EAGAIN and read origin. The kernel caps
# the backlog at net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 1024
EXPECTED = (ConnectionError, TimeoutError)  # a peer's doing, not a bug: counted, not traced


class BoundedServer(socketserver.ThreadingMixIn):
    """Mixin for a socketserver server. `name` says which server in the log; `metrics` (optional)
    counts `connections_dropped{reason}`; `max_per_peer` bounds concurrent connections per peer_of()."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    name = "server"
    max_per_peer = 256
    metrics = None
    read_timeout_s = 10.0

    def __init__(self, *args, **kwargs):
        self._conn_lock = threading.Lock()
        self._open: dict[object, int] = {}  # peer -> connections being served
        self._peer_of_request: dict[int, object] = {}
        self._warned: set[str] = set()
        super().__init__(*args, **kwargs)

    def peer_of(self, request, client_address) -> object:
        return client_address[0] if isinstance(client_address, tuple) and client_address else "local"

    def verify_request(self, request, client_address) -> bool:
        peer = self.peer_of(request, client_address)
        with self._conn_lock:
            if self._open.get(peer, 0) >= self.max_per_peer:
                over = True
            else:
                over = False
                self._open[peer] = self._open.get(peer, 0) + 1
                self._peer_of_request[id(request)] = peer
        if over:
            self.note("over_limit", f"{peer} holds {self.max_per_peer} connections already; refused another")
        return not over

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                peer = self._peer_of_request.pop(id(request), None)
                left = self._open.get(peer, 0) - 1
                if left > 0:
                    self._open[peer] = left
                else:
                    self._open.pop(peer, None)

    def handle_error(self, request, client_address):
        """Replaces socketserver's traceback on stderr for every failed connection (50 resets from a
        scanner were 1,200 lines): a peer's reset or timeout is counted and logged once per kind; an
        unexpected exception is a bug, logged with its traceback the first time."""
        exc = sys.exc_info()[1]
        if isinstance(exc, EXPECTED):
            self.note("reset" if isinstance(exc, ConnectionError) else "timeout",
                      f"{client_address}: {type(exc).__name__}: {exc}")
        else:
            self.note("error", f"{client_address}: {type(exc).__name__}: {exc} (a bug)", exc_info=True)

    def note(self, reason: str, detail: str, exc_info: bool = False) -> None:
        """Count a dropped connection; WARNING the first time per reason, DEBUG after."""
        if self.metrics is not None:
            self.metrics.inc("connections_dropped", f"{self.name.split()[0]}_{reason}")
        first = reason not in self._warned
        self._warned.add(reason)
        log.log(logging.WARNING if first else logging.DEBUG, "%s: connection dropped (%s): %s%s", self.name, reason,
                detail, "; later ones are counted in connections_dropped{reason}" if first else "",
                exc_info=exc_info and first)


class TimeoutHandler:
    """Mixin for a StreamRequestHandler: its socket times out after the server's read_timeout_s (a
    silent partial request held a thread and an fd for as long as its sender liked)."""

    def setup(self):
        self.timeout = self.server.read_timeout_s
        super().setup()
