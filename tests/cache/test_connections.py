"""How the daemon's servers take connections (serving.py): a node's workers connecting at once all get
in, a request once begun must arrive whole within `read_timeout_s`, one peer holds a bounded number
of connections, and a peer that resets its connections is counted, not traced, on every server."""

from __future__ import annotations

import http.client
import re
import socket
import struct
import subprocess
import threading
import time
import urllib.request

import pytest

from loongforge.cache.peer import sign
from loongforge.cache.protocol import Connection
from loongforge.cache.serving import LISTEN_BACKLOG
from tests.cache.cache_helpers import PEER_SECRET, counter, wait_for
from tests.conftest import free_port

pytestmark = pytest.mark.slow
SECRET_ENV = {"LOONGFORGE_CACHE_PEER_SECRET": PEER_SECRET}


def _ports(d) -> tuple[tuple[str, int], tuple[str, int]]:
    peer = re.search(r", peer ([^)]+)\)", d.log()).group(1)
    metrics = re.search(r"metrics on http://([^/]+)/metrics", d.log()).group(1)
    host, _, port = peer.rpartition(":")
    mhost, _, mport = metrics.rpartition(":")
    return (host, int(port)), (mhost, int(mport))


def test_a_nodes_workers_connecting_at_once_all_reach_the_daemon(synthetic_root, daemons):
    """64 trainer workers whose first read comes at the same instant: with a listen backlog of 5, 54 of
    them got `BlockingIOError: [Errno 11]` and read origin on this machine. Now all 64 are served."""
    root, index = synthetic_root
    d = daemons(root, index)
    name = index.shards[0].name
    clients = [d.client() for _ in range(64)]
    start = threading.Barrier(len(clients))
    counts: list[dict] = []

    def first_read(client):
        start.wait()
        client.read_shard(name)
        counts.append(dict(client.counts))
        client.close()

    threads = [threading.Thread(target=first_read, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(counts) == 64
    assert sum(c["origin_reads"] for c in counts) == 0 and sum(c["daemon_reads"] for c in counts) == 64, counts


def _listen_queue(kind: str, where: str) -> int:
    """The backlog the kernel holds for a listening socket: `ss` prints it as Send-Q."""
    args = ["ss", "-Hlxn"] if kind == "unix" else ["ss", "-Hltn", f"sport = :{where}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        cols = line.split()  # unix: Netid State Recv-Q Send-Q Path (bound under a temporary name) ...
        if kind != "unix":
            return int(cols[2])
        if cols[4].startswith(where):
            return int(cols[3])
    raise AssertionError(f"no listening socket {where} in `ss`:\n{out}")


def test_every_listen_queue_fits_a_nodes_workers(synthetic_root, daemons):
    """The socket, the peer port and the metrics port all listened with socketserver's backlog of 5
    (a fetch waited 1.05 s for a SYN retransmit while 400 connections were being made)."""
    root, index = synthetic_root
    d = daemons(root, index, extra=("--peer-listen", "127.0.0.1:0", "--metrics-port", str(free_port())),
                env=SECRET_ENV)
    (_, peer_port), (_, metrics_port) = _ports(d)
    queues = {"socket": _listen_queue("unix", d.socket), "peer": _listen_queue("tcp", str(peer_port)),
              "metrics": _listen_queue("tcp", str(metrics_port))}
    assert all(q >= LISTEN_BACKLOG for q in queues.values()), queues


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `seconds`; whatever it replies first is read."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_partial_requests_are_dropped_after_the_read_timeout(synthetic_root, daemons):
    """A request that never ends (no newline on the socket; an HTTP request line without its headers'
    end on the peer and metrics ports) stayed open 65 s, each holding a thread and an fd. With
    read_timeout_s 1 each is closed and counted; an idle connection between requests (a trainer
    between reads) is not a partial request and stays."""
    root, index = synthetic_root
    d = daemons(root, index, extra=("--peer-listen", "127.0.0.1:0", "--metrics-port", str(free_port())),
                env={**SECRET_ENV, "LOONGFORGE_CACHE_READ_TIMEOUT_S": "1"})
    peer, metrics = _ports(d)
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(d.socket)
    partial = socket.socket(socket.AF_UNIX)
    partial.connect(d.socket)
    partial.sendall(b'{"v": 1, "id": 1, "op": "hel')
    http = []
    for addr in (peer, metrics):
        s = socket.create_connection(addr)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the blank line that ends it never comes
        http.append(s)
    assert all(_closed_within(s, 15) for s in (partial, *http))
    idle.sendall(b'{"v": 1, "id": 1, "op": "hello"}\n')  # 1+ s later: still served
    idle.settimeout(10)
    assert b'"ok":true' in idle.recv(65536)
    st = d.stats()
    assert counter(st, "connections_dropped", "socket_timeout") == 1, st["counters"]["connections_dropped"]
    for s in (idle, partial, *http):
        s.close()


def test_connections_per_peer_are_bounded(synthetic_root, daemons):
    """One address held 400 idle connections to the peer port, a thread each. Now a peer gets at most
    its bound (64 on the peer port, 16 on the metrics port); the next is closed at once and counted,
    and a request from another address is served meanwhile."""
    root, index = synthetic_root
    name = index.shards[0].name
    d = daemons(root, index, extra=("--peer-listen", "127.0.0.1:0", "--metrics-port", str(free_port())),
                env=SECRET_ENV)
    d.request("get", shard=name)
    peer, metrics = _ports(d)
    held = [socket.create_connection(peer) for _ in range(64)] + [socket.create_connection(metrics) for _ in range(16)]
    over = [socket.create_connection(peer), socket.create_connection(metrics)]
    assert all(_closed_within(s, 15) for s in over)
    wait_for(lambda: counter(d.stats(), "connections_dropped", "peer_over_limit") == 1, what="the count")
    path = f"/shard/{name}"
    conn = http.client.HTTPConnection(*peer, timeout=10, source_address=("127.0.0.2", 0))
    conn.request("GET", path, headers=sign(PEER_SECRET.encode(), "GET", path, f"{peer[0]}:{peer[1]}"))
    assert conn.getresponse().status == 200
    conn.close()
    for s in held + over:
        s.close()
    st = d.stats()
    assert counter(st, "connections_dropped", "metrics_over_limit") == 1, st["counters"]["connections_dropped"]


def _reset(addr, payload: bytes) -> None:
    s = socket.create_connection(addr)
    s.sendall(payload)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    s.close()


def test_reset_connections_are_counted_not_traced(synthetic_root, daemons):
    """50 connections reset mid-request on the peer port wrote 50 ConnectionResetError tracebacks
    (1,200 lines, no secret needed). Now one WARNING per reason, the rest counted."""
    root, index = synthetic_root
    d = daemons(root, index, extra=("--peer-listen", "127.0.0.1:0", "--metrics-port", str(free_port())),
                env=SECRET_ENV)
    peer, metrics = _ports(d)
    for _ in range(50):
        _reset(peer, b"GET /shard/x HTTP/1.1\r\n")
        _reset(metrics, b"GET /metrics HTTP/1.1\r\n")
    wait_for(lambda: "connection dropped (reset)" in d.log() or "Traceback" in d.log(), what="the resets handled")
    time.sleep(1)  # the rest of them
    assert urllib.request.urlopen(f"http://{metrics[0]}:{metrics[1]}/metrics", timeout=10).status == 200
    log = d.log()
    assert "Traceback" not in log and "Exception occurred during processing" not in log, log[-3000:]
    assert counter(d.stats(), "connections_dropped", "peer_reset") >= 40
    warnings = [line for line in log.splitlines() if " WARNING " in line and "connection dropped (reset)" in line]
    assert 1 <= len(warnings) <= 2, warnings  # one for each of the two ports, at most


def test_a_connect_the_full_listen_queue_refuses_is_retried(tmp_path):
    """A unix socket whose listen queue is full refuses a connect at once (EAGAIN), which the client
    took for a dead daemon and read origin. Now it retries for up to CONNECT_RETRY_S: a daemon that
    starts accepting 0.3 s later gets the connection."""
    path = str(tmp_path / "s")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(0)
    queued = []
    with pytest.raises(BlockingIOError):  # fill the queue: connects succeed until the kernel refuses
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX)
            queued.append(s)
            s.setblocking(False)
            s.connect(path)
    accepted = []

    def accept_later():
        time.sleep(0.3)
        for _ in range(len(queued)):  # the queued ones but the refused last, and the client's
            accepted.append(server.accept()[0])

    threading.Thread(target=accept_later, daemon=True).start()
    conn = Connection(path, None, 5.0)
    conn.close()
    for s in queued + accepted:
        s.close()
    server.close()
