"""Malformed messages against a real daemon: each is answered with an error reply (or, past the line
limit, the connection is closed after one), nothing crashes a handler or reaches the log as a
traceback, and the daemon serves throughout."""

from __future__ import annotations

import json
import random
import socket

import pytest

from loongforge.cache import protocol
from loongforge.cache.protocol import ProtocolError, decode

GET = {"v": 1, "id": 1, "op": "get", "shard": "shards/shard-000000.tar"}
ANNOUNCE = {"v": 1, "id": 1, "op": "announce", "rank": 0, "epoch": 0, "shards": []}


def _with(base: dict, **fields) -> bytes:
    return json.dumps({**base, **fields}).encode()


def _raw(base: dict, field: str, literal: str) -> bytes:
    """`base` with `field` set to a literal json.dumps would not write (Infinity, 1e400, ...)."""
    return json.dumps({**base, field: "@"}).encode().replace(b'"@"', literal.encode())


# kind -> one line (without its newline); every one must get an error reply on a connection that stays usable
MALFORMED = {
    "not JSON": b"hello daemon",
    "empty line": b"",
    "a JSON array": b"[1, 2]",
    "a JSON string": b'"get"',
    "JSON null": b"null",
    "invalid UTF-8": b'{"v": 1, "op": "\xff\xfe"}',
    "NUL bytes": b'{"v": 1,\x00 "op": "hello"}',
    "trailing garbage": b'{"v": 1, "id": 1, "op": "hello"} trailing',
    "no version": b'{"id": 1, "op": "hello"}',
    "another version": _with({"id": 1, "op": "hello"}, v=2),
    "unknown op": _with(GET, op="format-disk"),
    "op not a string": _with(GET, op=["get"]),
    "get without shard": _with({"v": 1, "id": 1, "op": "get"}),
    "shard a number": _with(GET, shard=7),
    "shard an object": _with(GET, shard={"a": 1}),
    "shard leaves the root": _with(GET, shard="../../etc/passwd"),
    "rank Infinity": _raw(GET, "rank", "Infinity"),
    "rank -Infinity": _raw(GET, "rank", "-Infinity"),
    "rank NaN": _raw(GET, "rank", "NaN"),
    "rank 1e400 in announce": _raw(ANNOUNCE, "rank", "1e400"),
    "epoch -1e400 in announce": _raw(ANNOUNCE, "epoch", "-1e400"),
    "rank 2**70": _with(GET, rank=2**70),
    "rank of 5000 digits": _raw(GET, "rank", "9" * 5000),
    "rank 1.5": _with(GET, rank=1.5),
    "rank true": _with(GET, rank=True),
    "rank -1": _with(GET, rank=-1),
    "epoch a string": _with(ANNOUNCE, epoch="0"),
    "shards not a list": _with(ANNOUNCE, shards="shards/shard-000000.tar"),
    "shards of numbers": _with(ANNOUNCE, shards=[1, 2]),
    "renew shards an object": _with({"v": 1, "id": 1, "op": "renew"}, shards={}),
    "report reason a number": _with({"v": 1, "id": 1, "op": "report", "shard": GET["shard"]}, reason=5),
    "id NaN": b'{"v": 1, "id": NaN, "op": "hello"}',
    "100,000 nested [": b"[" * 100_000,
    "100,000 nested objects": b'{"a":' * 100_000,
    "nesting inside a field": _raw(GET, "shard", "[" * 5000 + "]" * 5000),
}


def test_decode_refuses_non_finite_and_deep_messages():
    for line in (b'{"a": Infinity}', b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e400}', b"[" * 100_000):
        with pytest.raises(ProtocolError):
            decode(line)
    assert decode(b'{"a": 1.5e3, "b": [[1]]}') == {"a": 1500.0, "b": [[1]]}


class _Conn:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.rfile = self.sock.makefile("rb")

    def ask(self, line: bytes) -> dict | None:
        """The reply to one line, or None if the daemon closed the connection."""
        self.sock.sendall(line + b"\n")
        reply = self.rfile.readline()
        return json.loads(reply) if reply else None

    def close(self):
        self.rfile.close()
        self.sock.close()


def _serving(d, index) -> None:
    conn = _Conn(d.socket)
    try:
        reply = conn.ask(_with(GET, shard=index.shards[1].name))
        assert reply["ok"] and reply["tier"] == "ram", reply
    finally:
        conn.close()


@pytest.mark.slow
def test_every_malformed_message_is_answered_and_the_daemon_serves_on(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index)
    conn = _Conn(d.socket)
    for kind, line in MALFORMED.items():
        reply = conn.ask(line)
        assert reply is not None and reply["ok"] is False and reply["error"]["type"] in (
            "ProtocolError", "UnsafePathError"), (kind, reply)
        assert conn.ask(b'{"v": 1, "id": 2, "op": "hello"}')["ok"], kind  # the connection is still usable
    rng = random.Random(0)
    valid = [json.dumps(m).encode() for m in (GET, ANNOUNCE, {"v": 1, "id": 3, "op": "stats"})]
    for i in range(300):  # random bytes, then valid messages with random bytes changed
        if i % 2:
            line = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            line = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                line[rng.randrange(len(line))] = rng.randrange(256)
            line = bytes(line)
        line = line.replace(b"\n", b" ")
        reply = conn.ask(line)
        assert reply is not None and ("error" in reply or reply["ok"]), (line, reply)
    conn.close()
    big = _Conn(d.socket)  # past the line limit: one error reply, then the connection is closed
    reply = big.ask(b'{"v": 1, "op": "announce", "shards": ["' + b"x" * (protocol.MAX_LINE + 8) + b'"]}')
    assert reply["ok"] is False and "exceeds" in reply["error"]["message"], reply
    assert big.rfile.readline() == b""
    big.close()
    _serving(d, index)
    log = d.log()
    assert "Traceback" not in log and "unexpectedly" not in log, log[-3000:]
    assert d.proc.poll() is None
