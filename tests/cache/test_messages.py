"""What `loongforge cache` says when something is off: one line a user can act on, never a traceback,
and nothing left behind by a start that failed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from loongforge.cache.protocol import MAX_LINE

pytestmark = pytest.mark.slow


def _answering(path: str, stats) -> threading.Thread:
    """Something on the socket that speaks the framing but answers `stats` with `stats` (another
    version of the daemon, another program): one connection, one reply."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        req = json.loads(conn.makefile("rb").readline(MAX_LINE))
        reply = {"v": 1, "id": req["id"], "ok": True, **({} if stats is None else {"stats": stats})}
        conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("stats", [{"node": "n1", "uptime_s": 3}, None, [1, 2]], ids=["no counters", "no stats", "a list"])
def test_stats_from_a_daemon_that_answers_oddly_is_one_line(tmp_path, stats):
    """`loongforge cache stats` against a daemon whose answer lacks what the table shows: a
    `KeyError: 'counters'` traceback. Now one line saying so and how to see the answer; exit 1."""
    sock = str(tmp_path / "c.sock")
    server = _answering(sock, stats)
    out = subprocess.run([sys.executable, "-m", "loongforge.cache", "stats", "--socket", sock],
                         capture_output=True, text=True, timeout=60)
    server.join(10)
    assert out.returncode == 1 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "not the stats this client reads" in out.stderr, out.stderr
    assert "--json" in out.stderr


def test_peer_port_in_use_is_one_line_and_leaves_no_ram_tier(synthetic_root, tmp_path):
    """A peer port another process holds: an `OSError: [Errno 98]` traceback, with the RAM tier made
    before it left behind. Now one line naming the field, and no RAM tier."""
    root, _ = synthetic_root
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--peer-listen",
                              f"127.0.0.1:{port}", "--ram-dir", str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd"),
                              "--socket", str(tmp_path / "c.sock")], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LOONGFORGE_CACHE_PEER_SECRET": "5f0e8c2a9b41d7e36c18f4a0b92d5e7c"})
    finally:
        taken.close()
    errors = [line for line in out.stderr.splitlines() if "loongforge.cache.store:" not in line]  # start-up log
    assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert errors[0].startswith(f"loongforge cache: error: peer_listen 127.0.0.1:{port}: cannot listen there"), errors
    assert not (tmp_path / "ram").exists() and not (tmp_path / "c.sock").exists()
