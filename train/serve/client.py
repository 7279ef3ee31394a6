"""A client of `loongforge serve` (or of Isaac-GR00T's own policy server) for users without
Isaac-GR00T installed: the same frames as its PolicyClient (protocol.py), numpy + pyzmq + msgpack only.

    from loongforge.train.serve.client import PolicyClient

    with PolicyClient("127.0.0.1", 5555, api_token=None) as policy:
        config = policy.get_modality_config()          # {"video": {"modality_keys": [...], ...}, ...}
        action, info = policy.get_action(observation)  # {action key: [B, horizon, D] float32}

Unlike the reference's client, a call that gets no reply within `timeout_ms` raises ServeError (and
the socket is rebuilt, since a REQ socket that sent and never heard back cannot send again); an
{"error": ...} reply raises RequestError with the server's line.
"""

from __future__ import annotations

from typing import Any

import zmq

from loongforge.shared.errors import ServeError
from loongforge.train.serve import protocol


class PolicyClient:
    def __init__(self, host: str = "127.0.0.1", port: int = 5555, *, api_token: str | None = None,
                 timeout_ms: int = 15000):
        self.host, self.port, self.api_token, self.timeout_ms = host, port, api_token, timeout_ms
        self.address = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        self.context = zmq.Context()
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.ipv6 = ":" in self.host
        sock.connect(self.address)
        return sock

    def call(self, endpoint: str, data: dict | None = None, *, requires_input: bool = True) -> Any:
        """One request and its reply (the reference's call_endpoint)."""
        self.socket.send(protocol.request_frame(endpoint, data, api_token=self.api_token,
                                                requires_input=requires_input))
        if not self.socket.poll(self.timeout_ms, zmq.POLLIN):
            self.socket.close(linger=0)
            self.socket = self._connect()
            raise ServeError(f"{endpoint}: no reply from {self.address} within {self.timeout_ms / 1000:g} s; is "
                             "`loongforge serve` running there?")
        return protocol.parse_reply(self.socket.recv())

    def ping(self) -> bool:
        try:
            return self.call("ping", requires_input=False) == protocol.PING_REPLY
        except ServeError:
            return False

    def get_action(self, observation: dict, options: dict | None = None) -> tuple[dict, dict]:
        action, info = self.call("get_action", {"observation": observation, "options": options})
        return action, info

    def reset(self, options: dict | None = None) -> dict:
        return self.call("reset", {"options": options})

    def get_modality_config(self) -> dict[str, dict]:
        """{modality: ModalityConfig fields as a dict} (the reference's client builds ModalityConfig objects)."""
        return self.call("get_modality_config", requires_input=False)

    def kill_server(self) -> None:
        self.call("kill", requires_input=False)

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)
            self.context.term()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
