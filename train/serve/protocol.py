"""Isaac-GR00T's policy-server wire format, the one place that encodes and decodes it.

Isaac-GR00T N1.6 (gr00t/policy/server_client.py) speaks it over a ZeroMQ REQ/REP socket, one
msgpack frame each way:

    request  {"endpoint": NAME, "data": {...}, "api_token": TOKEN}   ("data" only for endpoints that
             take input, "api_token" only when the client has one; no "endpoint" means get_action)
    reply    the endpoint's result, or {"error": "<one line>"}

    ping                 -> {"status": "ok", "message": "Server is running"}
    kill                 -> nil, then the server stops
    get_action           data {"observation": OBS, "options": OPTS | nil} -> [action, info]
    reset                data {"options": OPTS | nil} -> info (a map)
    get_modality_config  -> {modality: {"__ModalityConfig_class__": true, "as_json": {...}}}

msgpack as the reference packs it (msgpack-python's defaults: bin type for bytes, str for text;
unpacked with raw=False, strict_map_key=True). A numpy array travels as the map
{"__ndarray_class__": true, "as_npy": <the bytes np.save writes, allow_pickle=False>}, keys in that
order, so our frames are byte-for-byte the reference's.

What we do differently, for safety: an incoming frame is unpacked with no hook at all, the token is
checked, and only then are the arrays decoded (so an unauthenticated client never reaches the npy
parser). An array is read from its .npy header and bytes directly: numeric dtypes only, never a
pickle, never an .npz archive (which np.load would open lazily), and a header whose shape does not
match the bytes that follow is refused before anything is allocated.
"""

from __future__ import annotations

import hmac
import io
import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from loongforge.shared.errors import RequestError

NDARRAY = "__ndarray_class__"
MODALITY = "__ModalityConfig_class__"
# Each endpoint and the keys its "data" may hold (None: it takes no input; "data" is ignored, as the
# reference ignores it). The first key of a tuple is required.
ENDPOINTS: dict[str, tuple[str, ...] | None] = {
    "ping": None, "kill": None, "get_modality_config": None,
    "get_action": ("observation", "options"), "reset": ("options",),
}
DEFAULT_ENDPOINT = "get_action"  # the reference's default when a request names none
UNAUTHORIZED = "Unauthorized: Invalid API token"  # the reference's words: clients may match on them
PING_REPLY = {"status": "ok", "message": "Server is running"}
MAX_ERROR_CHARS = 300  # an error reply is one line, however long what it quotes
MAX_DEPTH = 16  # nesting of a request (an observation is 3 deep); deeper is refused, not recursed into
NUMERIC_KINDS = "biufc"  # dtypes an array may have: bool, ints, floats, complex; never object/str/void


# ---- encoding (replies, and our client's requests) ----


def pack(obj: Any) -> bytes:
    """obj -> one msgpack frame, arrays as the reference's .npy maps."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in NUMERIC_KINDS:
            raise TypeError(f"array of dtype {obj.dtype} does not travel (numeric dtypes only)")
        buf = io.BytesIO()
        np.save(buf, obj, allow_pickle=False)
        return {NDARRAY: True, "as_npy": buf.getvalue()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def request_frame(endpoint: str, data: dict | None = None, *, api_token: str | None = None,
                  requires_input: bool = True) -> bytes:
    """The frame the reference's PolicyClient.call_endpoint sends, key for key."""
    request: dict = {"endpoint": endpoint}
    if requires_input:
        request["data"] = data
    if api_token:
        request["api_token"] = api_token
    return pack(request)


def modality_reply(configs: dict[str, dict]) -> dict:
    """{modality: ModalityConfig fields} -> the reference's get_modality_config reply, each config
    wrapped as its client decodes it into a ModalityConfig."""
    return {name: {MODALITY: True, "as_json": cfg} for name, cfg in configs.items()}


def one_line(message: str) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def error_reply(message: str) -> bytes:
    return pack({"error": one_line(message)})


def short(value: Any, limit: int = 60) -> str:
    """A client's value quoted in an error, bounded: an error line never echoes a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---- decoding (requests on the server; replies on our client) ----


@dataclass(frozen=True, slots=True)
class Request:
    endpoint: str
    data: dict  # the endpoint's input, arrays decoded; {} for endpoints that take none


def parse_request(frame: bytes, api_token: str | None) -> Request:
    """One request frame -> Request. RequestError (its message the one-line reply) for a frame that is
    not msgpack, not a map, without the server's token, for an unknown endpoint or a bad "data"."""
    raw = unpack_plain(frame, "request")
    if not isinstance(raw, dict):
        raise RequestError(f"a request is a msgpack map {{endpoint, data, api_token}}; got {type(raw).__name__}")
    if api_token is not None and not token_matches(raw.get("api_token"), api_token):
        raise RequestError(UNAUTHORIZED)
    endpoint = raw.get("endpoint", DEFAULT_ENDPOINT)
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise RequestError(f"Unknown endpoint: {short(endpoint)} (this server has {', '.join(ENDPOINTS)})")
    args = ENDPOINTS[endpoint]
    if args is None:
        return Request(endpoint, {})
    data = raw.get("data")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise RequestError(f"{endpoint}: 'data' must be a map with keys {list(args)}; got {type(data).__name__}")
    extra = [k for k in data if k not in args]
    if extra:
        raise RequestError(f"{endpoint}: 'data' has unknown key(s) {short(extra)}; it takes {list(args)}")
    if endpoint == "get_action" and "observation" not in data:
        raise RequestError("get_action: 'data' needs 'observation' (a map of video, state, language)")
    return Request(endpoint, with_arrays(data, endpoint))


def unpack_plain(frame: bytes, what: str) -> Any:
    """msgpack -> Python objects, no hook: arrays stay as their {"__ndarray_class__", "as_npy"} maps."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises ValueError, TypeError, StackError, ExtraData, ...
        raise RequestError(f"malformed msgpack {what} frame ({len(frame)} bytes): {type(exc).__name__}: "
                           f"{short(str(exc), 80)}") from None


def token_matches(given: Any, expected: str) -> bool:
    """The reference compares with ==; this compares in constant time, same answer."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def with_arrays(obj: Any, where: str, depth: int = 0) -> Any:
    """`obj` with every .npy map decoded into a (read-only) numpy array, and every ModalityConfig map
    replaced by its fields (our client keeps them as plain dicts: no class is built from the wire)."""
    if depth > MAX_DEPTH:
        raise RequestError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if NDARRAY in obj:
            return decode_npy(obj.get("as_npy"), where)
        if MODALITY in obj:
            return with_arrays(obj.get("as_json"), where, depth + 1)
        return {k: with_arrays(v, f"{where}.{k}", depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [with_arrays(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    return obj


def decode_npy(data: Any, where: str) -> np.ndarray:
    """.npy bytes (format 1.0 or 2.0, as np.save writes) -> an array viewing them."""
    if not isinstance(data, bytes):
        raise RequestError(f"{where}: an ndarray map needs 'as_npy' bytes (np.save output); got {type(data).__name__}")
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"npy format {version}")
    except Exception as exc:  # noqa: BLE001 - numpy's header parser raises ValueError, SyntaxError, ...
        raise RequestError(f"{where}: not .npy bytes ({type(exc).__name__}: {short(str(exc), 80)})") from None
    if dtype.hasobject or dtype.kind not in NUMERIC_KINDS or dtype.subdtype is not None:
        raise RequestError(f"{where}: arrays of dtype {short(str(dtype))} are refused (numeric dtypes only)")
    count = math.prod(shape)
    need, have = count * dtype.itemsize, len(data) - f.tell()
    if need != have:
        raise RequestError(f"{where}: the .npy header says shape {short(shape)} {dtype} ({need} bytes), "
                           f"{have} bytes follow it")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=f.tell())
    return arr.reshape(shape, order="F" if fortran else "C")


def parse_reply(frame: bytes) -> Any:
    """One reply frame -> its value (arrays decoded). RequestError with the server's line for an
    {"error": ...} reply, as the reference's client raises on one."""
    value = with_arrays(unpack_plain(frame, "reply"), "reply")
    if isinstance(value, dict) and "error" in value:
        raise RequestError(f"server error: {value['error']}")
    return value
