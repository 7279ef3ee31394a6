"""The policy server: one ZeroMQ REP socket answering Isaac-GR00T's protocol (protocol.py) from a
backend (backend.py), one request at a time, until `kill`, SIGTERM or Ctrl-C.

    server = PolicyServer(ServeConfig(port=5555))   # binds now: a busy port fails before the model loads
    server.serve_forever(backend)

REQ/REP: every request gets exactly one reply, so a refused request is answered too, with
{"error": "<one line>"}; nothing a client sends ends the loop but `kill`. A frame larger than
`max_request_bytes` is dropped by ZeroMQ itself (the peer is disconnected; its REQ times out). A bug
behind an endpoint is answered as an internal error, logged once with its traceback, and the server
goes on.

Who may ask: anyone who can reach the port. So the server binds loopback unless given a token
(`api_token`, read from a key file only its owner can read); with one, every request must carry it
("api_token", compared as the reference compares, in constant time). The token is checked before any
array in the request is decoded. It authenticates; it does not encrypt (README, Deploy a policy).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from loongforge.shared.errors import ConfigError, LoongForgeError, RequestError, ServeError
from loongforge.train.serve import protocol

log = logging.getLogger(__name__)
MIN_TOKEN = 16  # characters of an API token (`openssl rand -hex 32` gives 64)
LOG_EVERY_S = 10.0  # refused requests are logged as one summary line at most this often
TIMINGS = 100_000  # per-request timing records kept (the benchmark reads them)


class Backend(Protocol):
    """What the server serves (backend.py: PolicyBackend). `prepare` checks and preprocesses one
    request's observation (B samples), raising RequestError with one line naming the key and the shape
    or dtype expected; `run` answers all B in one forward: ({action key: [B, horizon, D]}, info)."""

    def get_modality_config(self) -> dict[str, dict]: ...

    def prepare(self, observation: Any, options: Any) -> Any: ...

    def run(self, prepared: Any) -> tuple[dict, dict]: ...

    def reset(self, options: Any) -> dict: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs `api_token`."""
    port: int = 5555
    """TCP port; 0 = any free port (the bound one is `PolicyServer.endpoint`)."""
    api_token: str | None = field(default=None, repr=False)
    """The token every request must carry (from --api-token-file); None = no check (loopback only)."""
    max_request_bytes: int = 256 << 20
    """Largest request frame ZeroMQ accepts (8 x 2 cameras of 1080p frames is ~100 MB)."""
    poll_ms: int = 100
    """How often the loop looks at its stop flag between requests (SIGTERM latency)."""

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port}: not a TCP port")
        if self.max_request_bytes < 1 << 10 or self.poll_ms < 1:
            raise ConfigError("max_request_bytes must be >= 1 KiB and poll_ms >= 1")
        if self.api_token is not None and len(self.api_token) < MIN_TOKEN:
            raise ConfigError(f"API token: {len(self.api_token)} characters, at least {MIN_TOKEN} are needed "
                              "(`openssl rand -hex 32 > FILE`)")
        if self.api_token is None and not is_loopback(self.host):
            raise ConfigError(f"--host {self.host} is not loopback: anyone who reaches the port could query the "
                              "policy and stop the server; give --api-token-file FILE (a token file only you can "
                              "read: `openssl rand -hex 32 > FILE && chmod 600 FILE`) or bind 127.0.0.1")

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port or '*'}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or "*" (every interface)


def read_token_file(path: str) -> str:
    """The API token from `path`: a regular file of this user (or root) that no one else may read or
    write, since whoever reads it may drive the policy and stop the server. One ConfigError otherwise."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(1 << 12)
    except OSError as exc:
        raise ConfigError(f"--api-token-file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
        raise ConfigError(f"--api-token-file {path} ({stat.filemode(st.st_mode)}, owner uid {st.st_uid}) must be a "
                          "file of this user that no one else can read: whoever reads it can query the policy and "
                          "stop the server. chmod 600 it")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"--api-token-file {path}: not UTF-8 text (`openssl rand -hex 32 > FILE`)") from None
    return token


@dataclass(slots=True)
class Timing:
    endpoint: str
    batch: int
    decode_s: float  # msgpack + token + arrays
    preprocess_s: float  # the backend's checks and preprocessing (prepare)
    model_s: float  # the backend's run: the forward(s) and the actions per key
    encode_s: float  # the reply frame


class PolicyServer:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, cfg.max_request_bytes)
        self.socket.ipv6 = ":" in cfg.host
        try:
            self.socket.bind(cfg.bind_address)
        except zmq.ZMQError as exc:
            self.close()
            raise ServeError(f"cannot listen on {cfg.bind_address}: {exc} (another server on that port? "
                             "--port)") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stopping = False
        self.served = 0
        self.refused: collections.Counter = collections.Counter()  # one-line reason head -> count
        self.timings: collections.deque[Timing] = collections.deque(maxlen=TIMINGS)
        self._unlogged, self._logged_at, self._seen_bugs = 0, 0.0, set()

    def stop(self, *_) -> None:
        """Ends the loop after the request in hand (safe from a signal handler)."""
        self.stopping = True

    def serve_forever(self, backend: Backend) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self.stopping:
                if not poller.poll(self.cfg.poll_ms):
                    continue
                frames = self.socket.recv_multipart()
                reply, stop = self.answer(frames, backend)
                self.socket.send(reply)
                self.stopping |= stop
        finally:
            self._flush_refusals()
            self.close()

    def answer(self, frames: list[bytes], backend: Backend) -> tuple[bytes, bool]:
        """One request -> (its reply frame, whether the server stops after sending it)."""
        t0 = time.perf_counter()
        try:
            if len(frames) != 1:
                raise RequestError(f"a request is one frame (a REQ socket's send); got {len(frames)}")
            req = protocol.parse_request(frames[0], self.cfg.api_token)
            t1 = time.perf_counter()
            if req.endpoint == "get_action":
                prepared = backend.prepare(req.data["observation"], req.data.get("options"))
                t2 = time.perf_counter()
                result = backend.run(prepared)
                t3 = time.perf_counter()
                reply = protocol.pack(result)
                self.timings.append(Timing("get_action", getattr(prepared, "size", 0), t1 - t0, t2 - t1, t3 - t2,
                                           time.perf_counter() - t3))
            else:
                reply = protocol.pack(self._other(req, backend))
            self.served += 1
            return reply, req.endpoint == "kill"
        except LoongForgeError as exc:  # a refused request (RequestError) or one the policy refused
            self._refuse(str(exc))
            return protocol.error_reply(str(exc)), False
        except Exception as exc:  # noqa: BLE001 - a bug behind an endpoint must not end the server
            kind = type(exc).__name__
            if kind not in self._seen_bugs:
                self._seen_bugs.add(kind)
                log.exception("internal error answering a request (logged once per kind)")
            self._refuse(f"internal error: {kind}")
            return protocol.error_reply(f"internal error: {kind}: {exc}"), False

    def _other(self, req: protocol.Request, backend: Backend):
        if req.endpoint == "ping":
            return protocol.PING_REPLY
        if req.endpoint == "kill":
            log.info("kill received: stopping")
            return None  # the reference replies nil
        if req.endpoint == "reset":
            return backend.reset(req.data.get("options"))
        return protocol.modality_reply(backend.get_modality_config())

    def _refuse(self, message: str) -> None:
        head = protocol.one_line(message).split(":")[0][:60]
        self.refused[head] += 1
        self._unlogged += 1
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            self._flush_refusals(last=protocol.one_line(message))

    def _flush_refusals(self, last: str | None = None) -> None:
        if self._unlogged:
            log.warning("refused %d request(s) since the last report%s", self._unlogged,
                        f"; the latest: {last}" if last else "")
            self._unlogged, self._logged_at = 0, time.monotonic()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc) -> None:
        if not self.socket.closed:
            self.close()
