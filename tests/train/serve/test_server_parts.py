"""The server's parts without a model: the address and token-file rules, a backend that fails in
ways no request should reach (answered, logged once, the loop goes on), and the client's timeout.
A real socket and a real server thread; only the backend is a stand-in."""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest

from loongforge.shared.errors import ConfigError, RequestError, ServeError
from loongforge.train.serve import protocol
from loongforge.train.serve.client import PolicyClient
from loongforge.train.serve.server import PolicyServer, ServeConfig, read_token_file

TOKEN = "0123456789abcdef0123"


@pytest.mark.parametrize("host, token, ok", [
    ("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True), ("127.0.0.2", None, True),
    ("0.0.0.0", None, False), ("*", None, False), ("10.1.2.3", None, False), ("robot.lan", None, False),
    ("0.0.0.0", TOKEN, True), ("0.0.0.0", "short", False),
])
def test_another_address_needs_a_token(host, token, ok):
    if ok:
        ServeConfig(host=host, api_token=token)
    else:
        with pytest.raises(ConfigError) as info:
            ServeConfig(host=host, api_token=token)
        assert "\n" not in str(info.value)
        assert ("--api-token-file" in str(info.value)) or ("at least 16" in str(info.value))


def test_the_token_file_must_be_private(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert read_token_file(str(f)) == TOKEN
    for mode in (0o640, 0o604, 0o660):
        f.chmod(mode)
        with pytest.raises(ConfigError, match="no one else can read"):
            read_token_file(str(f))
    with pytest.raises(ConfigError, match="No such file"):
        read_token_file(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="Is a directory"):
        read_token_file(str(tmp_path))


class Backend:
    """Stands in for PolicyBackend: a valid observation is any map with key "ok"."""

    def __init__(self):
        self.calls = 0

    def get_modality_config(self):
        return {"video": {"delta_indices": [0], "modality_keys": ["front"]}}

    def prepare(self, observation, options):
        self.calls += 1
        if observation.get("boom"):
            raise KeyError("a bug")  # not a RequestError: what no request should reach
        if "ok" not in observation:
            raise RequestError("observation['video']['front'] missing")
        return observation

    def run(self, prepared):
        return {"arm": np.ones((1, 2, 3), np.float32)}, {}

    def reset(self, options):
        return {"reset": True}


@pytest.fixture
def served():
    server = PolicyServer(ServeConfig(port=0, api_token=TOKEN, poll_ms=20))
    backend = Backend()
    thread = threading.Thread(target=server.serve_forever, args=(backend,), daemon=True)
    thread.start()
    port = int(server.endpoint.rsplit(":", 1)[1])
    yield server, backend, port, thread
    server.stop()
    thread.join(10)


def test_a_bug_behind_an_endpoint_is_answered_logged_once_and_the_server_goes_on(served, caplog):
    server, backend, port, _ = served
    with PolicyClient("127.0.0.1", port, api_token=TOKEN) as client:
        for _ in range(3):
            with pytest.raises(RequestError, match=r"^server error: internal error: KeyError: 'a bug'$"):
                client.get_action({"boom": True})
        with pytest.raises(RequestError, match=r"missing"):
            client.get_action({})
        action, info = client.get_action({"ok": 1})
        assert action["arm"].shape == (1, 2, 3) and info == {}
        assert client.reset() == {"reset": True} and client.ping()
        assert client.get_modality_config()["video"]["modality_keys"] == ["front"]
    assert sum(r.exc_info is not None for r in caplog.records) == 1  # one traceback, not three
    assert server.refused["internal error"] == 3 and server.served == 4  # get_action, reset, ping, config
    assert [t.endpoint for t in server.timings] == ["get_action"]


def test_kill_replies_nil_and_stops_the_loop(served):
    server, _, port, thread = served
    with PolicyClient("127.0.0.1", port, api_token=TOKEN) as client:
        assert client.call("kill", requires_input=False) is None
    thread.join(10)
    assert not thread.is_alive() and server.socket.closed


def test_a_frame_over_the_limit_is_dropped_and_the_server_goes_on(tmp_path):
    server = PolicyServer(ServeConfig(port=0, max_request_bytes=1 << 16, poll_ms=20))
    thread = threading.Thread(target=server.serve_forever, args=(Backend(),), daemon=True)
    thread.start()
    port = int(server.endpoint.rsplit(":", 1)[1])
    try:
        with PolicyClient("127.0.0.1", port, timeout_ms=1000) as client:
            with pytest.raises(ServeError, match="no reply from"):
                client.get_action({"ok": np.zeros(1 << 17, np.uint8)})
            action, _ = client.get_action({"ok": np.zeros(16, np.uint8)})  # the rebuilt socket works
            assert action["arm"].shape == (1, 2, 3)
    finally:
        server.stop()
        thread.join(10)


def test_the_client_times_out_without_a_server():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with PolicyClient("127.0.0.1", port, timeout_ms=300) as client:
        assert not client.ping()
        with pytest.raises(ServeError, match=r"^ping: no reply from tcp://127.0.0.1:\d+ within 0.3 s"):
            client.call("ping", requires_input=False)


def test_a_busy_port_is_one_error():
    with PolicyServer(ServeConfig(port=0)) as first:
        port = int(first.endpoint.rsplit(":", 1)[1])
        with pytest.raises(ServeError, match=f"cannot listen on tcp://127.0.0.1:{port}"):
            PolicyServer(ServeConfig(port=port))


def test_the_error_line_for_a_raw_frame(served):
    """The reply to bytes that are not msgpack, read with plain msgpack (as any client would)."""
    import zmq

    _, _, port, _ = served
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(b"\xc1garbage")
        reply = msgpack.unpackb(sock.recv())
        assert list(reply) == ["error"] and reply["error"].startswith("malformed msgpack request frame (8 bytes)")
        sock.send(protocol.request_frame("ping", requires_input=False, api_token=TOKEN))
        assert msgpack.unpackb(sock.recv()) == protocol.PING_REPLY
    finally:
        sock.close(linger=0)
        ctx.term()
