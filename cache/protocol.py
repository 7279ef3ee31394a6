"""Wire format between clients and the daemon: newline-delimited JSON, one
request -> one response, in order, on a persistent connection. Spec:
PROTOCOL.md. Shard bytes never cross the socket; replies carry tier paths.
"""

from __future__ import annotations

import json
import socket
import struct

from loongforge.shared import errors

PROTOCOL_VERSION = 1
MAX_LINE = 16 << 20  # an announce of ~200k shard names; anything longer is rejected
OPS = ("hello", "get", "report", "renew", "release", "announce", "stats", "stop")

# Errors the daemon may report, mapped back to the same classes on the client.
_ERRORS = {cls.__name__: cls for cls in (
    errors.UnsafePathError, errors.ShardNotFoundError, errors.IntegrityError, errors.ConfigError,
    errors.CacheError, errors.CacheUnavailableError)}


class ProtocolError(errors.CacheError):
    """A malformed message, an unknown op, or an unsupported protocol version."""


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        msg = json.loads(line)
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


class Connection:
    """A blocking client connection with one overall deadline per request."""

    def __init__(self, socket_path: str | None, tcp: str | None, timeout: float):
        family, addr = parse_endpoint(socket_path, tcp)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.connect(addr)
        except BaseException:
            self.sock.close()
            raise
        self.rfile = self.sock.makefile("rb")
        self._next_id = 0
        # The daemon's uid as the kernel reports it (unix sockets only): tier files it hands out must
        # be owned by it. None over TCP, where the client verifies the bytes instead.
        self.peer_uid: int | None = None
        if family == socket.AF_UNIX and hasattr(socket, "SO_PEERCRED"):
            creds = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self.peer_uid = struct.unpack("3i", creds)[1]

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
