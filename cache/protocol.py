"""Wire format between clients and the daemon: newline-delimited JSON, one
request -> one response, in order, on a persistent connection. Spec:
PROTOCOL.md. Shard bytes never cross the socket; replies carry tier paths.
"""

from __future__ import annotations

import json
import math
import socket
import time

from loongforge.shared import errors

PROTOCOL_VERSION = 1
MAX_LINE = 16 << 20  # an announce of ~200k shard names; anything longer is rejected
CONNECT_RETRY_S = 2.0  # how long a client retries a connect the daemon's full listen queue refused
OPS = ("hello", "get", "report", "renew", "release", "announce", "stats", "stop")

# Errors the daemon may report, mapped back to the same classes on the client.
_ERRORS = {cls.__name__: cls for cls in (
    errors.UnsafePathError, errors.ShardNotFoundError, errors.IntegrityError, errors.ConfigError,
    errors.CacheError, errors.CacheUnavailableError)}


class ProtocolError(errors.CacheError):
    """A malformed message, an unknown op, or an unsupported protocol version."""


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ProtocolError(f"number {text[:40]} is out of range: numbers must be finite")
    return value


def _no_constant(name: str):
    raise ProtocolError(f"{name} is not a JSON number: numbers must be finite")


def decode(line: bytes) -> dict:
    """One message; ProtocolError for anything but a JSON object of finite numbers. Python's json
    reads NaN, Infinity and 1e400 unless told not to, and raises RecursionError on deep nesting
    (100,000 `[`): both are answered as malformed messages, never as a crashed handler."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        msg = json.loads(line, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise ProtocolError("message nested too deep (no message of this protocol nests more than 4 levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not a JSON message: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    return msg


def error_reply(req_id, exc: BaseException) -> dict:
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS or isinstance(exc, ProtocolError) else "CacheError"
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": {"type": kind, "message": str(exc)}}


def raise_error(reply: dict) -> None:
    err = reply.get("error") or {}
    cls = _ERRORS.get(err.get("type"), ProtocolError if err.get("type") == "ProtocolError" else errors.CacheError)
    raise cls(err.get("message", "unknown daemon error"))


def parse_endpoint(socket_path: str | None, tcp: str | None) -> tuple[int, object]:
    """(address family, address) for socket.connect / servers."""
    if tcp:
        host, _, port = tcp.rpartition(":")
        host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    return socket.AF_UNIX, socket_path


def _connect(family: int, addr, timeout: float) -> socket.socket:
    """A connected socket. A unix socket whose listen queue is full refuses at once (EAGAIN): when
    every worker of a node connects at start, a daemon busy accepting is not a daemon that is gone,
    so the connect is retried with backoff for up to CONNECT_RETRY_S before the caller reads origin."""
    deadline = time.monotonic() + min(timeout, CONNECT_RETRY_S)
    pause = 0.002
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise
        except BaseException:
            sock.close()
            raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


class Connection:
    """A blocking client connection with one overall deadline per request."""

    def __init__(self, socket_path: str | None, tcp: str | None, timeout: float):
        family, addr = parse_endpoint(socket_path, tcp)
        self.timeout = timeout
        self.sock = _connect(family, addr, timeout)
        self.rfile = self.sock.makefile("rb")
        self._next_id = 0
        # The daemon's uid as the kernel reports it, set by access.connect (peer_uid): tier files it
        # hands out must be owned by it. None where it cannot be told.
        self.peer_uid: int | None = None

    def request(self, op: str, **fields) -> dict:
        self._next_id += 1
        msg = {"v": PROTOCOL_VERSION, "id": self._next_id, "op": op, **fields}
        self.sock.sendall(encode(msg))
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            raise ConnectionError("daemon closed the connection")
        reply = decode(line)
        if reply.get("id") != self._next_id:
            raise ProtocolError(f"reply id {reply.get('id')} != request id {self._next_id}")
        if not reply.get("ok"):
            raise_error(reply)
        return reply

    def close(self) -> None:
        try:
            self.rfile.close()
        finally:
            self.sock.close()
