"""The wire format against Isaac-GR00T's own bytes (gr00t_frames.json: frames its MsgSerializer wrote),
and the decoder's refusals: every malformed frame is one RequestError line, never a pickle, never an
allocation the frame did not pay for."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import msgpack
import numpy as np
import pytest

from loongforge.shared.errors import RequestError
from loongforge.train.serve import protocol

FRAMES = {k: bytes.fromhex(v) for k, v in json.loads(Path(__file__).with_name("gr00t_frames.json").read_text())
          .items() if not k.startswith("_")}
LANG = "annotation.human.action.task_description"
OBS = {"video": {"front": np.arange(12, dtype=np.uint8).reshape(1, 1, 2, 2, 3)},
       "state": {"arm": np.array([[[0.5, -1.25]]], np.float32)},
       "language": {LANG: [["pick"]]}}


def test_our_frames_are_the_reference_clients_and_servers_bytes():
    assert protocol.request_frame("get_action", {"observation": OBS, "options": None}, api_token="tok") == \
        FRAMES["get_action_request"]
    assert protocol.request_frame("kill", requires_input=False) == FRAMES["kill_request"]
    assert protocol.request_frame("reset", {"options": None}) == FRAMES["reset_request"]
    assert protocol.pack(({"arm": np.array([[[1.0], [2.0]]], np.float32)}, {})) == FRAMES["get_action_reply"]
    assert protocol.pack(None) == FRAMES["kill_reply"]
    assert protocol.pack(protocol.PING_REPLY) == FRAMES["ping_reply"]
    assert protocol.error_reply(protocol.UNAUTHORIZED) == FRAMES["unauthorized_reply"]
    modality = {"action": {"delta_indices": [0, 1], "modality_keys": ["arm"], "sin_cos_embedding_keys": None,
                           "mean_std_embedding_keys": None, "action_configs": [
                               {"rep": "ABSOLUTE", "type": "NON_EEF", "format": "DEFAULT", "state_key": None}]}}
    assert protocol.pack(protocol.modality_reply(modality)) == FRAMES["modality_reply"]


def test_the_reference_clients_request_parses_into_its_observation():
    req = protocol.parse_request(FRAMES["get_action_request"], api_token="tok")
    assert req.endpoint == "get_action" and req.data["options"] is None
    obs = req.data["observation"]
    for kind in ("video", "state"):
        (key, want), = OBS[kind].items()
        assert obs[kind][key].dtype == want.dtype and np.array_equal(obs[kind][key], want)
    assert obs["language"] == {LANG: [["pick"]]}
    action, info = protocol.parse_reply(FRAMES["get_action_reply"])
    assert info == {} and action["arm"].tolist() == [[[1.0], [2.0]]]


def test_the_token_is_checked_before_any_array_is_decoded(monkeypatch):
    monkeypatch.setattr(protocol, "decode_npy", lambda *a: pytest.fail("array decoded before the token check"))
    for token in ("other", None):
        with pytest.raises(RequestError, match="^Unauthorized: Invalid API token$"):
            protocol.parse_request(FRAMES["get_action_request"], api_token=token or "x" * 16)
    no_token = protocol.request_frame("ping", requires_input=False)
    with pytest.raises(RequestError, match="Unauthorized"):
        protocol.parse_request(no_token, api_token="x" * 16)
    assert protocol.parse_request(no_token, api_token=None).endpoint == "ping"  # no token configured: as the reference


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _frame(as_npy) -> bytes:
    return protocol.pack({"endpoint": "get_action", "data": {"observation": {"x": {protocol.NDARRAY: True,
                                                                                    "as_npy": as_npy}}}})


def _lying_header(shape: tuple) -> bytes:
    """A valid .npy header for `shape` followed by 4 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 4


@pytest.mark.parametrize("as_npy, says", [
    (pickle.dumps(np.zeros(2)), "not .npy bytes"),
    (_npy(np.zeros(3)).replace(b"<f8", b"|O8"), "refused"),  # an object array whose header looks fine
    (np.lib.format.MAGIC_PREFIX + b"\x01\x00" + b"\xff\xff" + b"{" * 10, "not .npy bytes"),
    (b"PK\x03\x04" + b"\0" * 40, "not .npy bytes"),  # an .npz (zip) archive: np.load would open it
    (_lying_header((1 << 40,)), "the .npy header says shape"),  # a terabyte promised, 4 bytes sent
    (_lying_header((2, 3)), "24 bytes), 4 bytes follow"),
    (_npy(np.array(["a"])), "refused"),  # strings
    (_npy(np.zeros(2, dtype=[("a", "<f4")])), "refused"),  # structured
    ("text", "needs 'as_npy' bytes"),
    (None, "needs 'as_npy' bytes"),
])
def test_malformed_arrays_are_one_line_refusals(as_npy, says):
    with pytest.raises(RequestError) as info:
        protocol.parse_request(_frame(as_npy), api_token=None)
    msg = str(info.value)
    assert says in msg and "\n" not in msg and len(msg) <= protocol.MAX_ERROR_CHARS, msg


@pytest.mark.parametrize("frame, says", [
    (b"", "malformed msgpack request frame (0 bytes)"),
    (b"\xc1", "malformed msgpack"),  # a reserved byte
    (msgpack.packb({"endpoint": "ping"}) + b"\x00", "malformed msgpack"),  # trailing bytes
    (msgpack.packb({1: 2}), "malformed msgpack"),  # strict_map_key: an int key
    (b"\x91" * 5000 + b"\xc0", "malformed msgpack"),  # nested past msgpack's stack
    (msgpack.packb([1, 2]), "a request is a msgpack map"),
    (msgpack.packb({"endpoint": "shutdown"}), "Unknown endpoint: 'shutdown' (this server has ping, kill"),
    (msgpack.packb({"endpoint": 7}), "Unknown endpoint: 7"),
    (msgpack.packb({"endpoint": "get_action", "data": [1]}), "'data' must be a map"),
    (msgpack.packb({"endpoint": "get_action", "data": {}}), "needs 'observation'"),
    (msgpack.packb({"data": {"observation": {}, "extra": 1}}), "unknown key(s) ['extra']"),  # get_action by default
    (msgpack.packb({"endpoint": "get_action", "data": {"observation": [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}}),
     "nested deeper than"),
    (msgpack.packb({"endpoint": "x" * 10_000}), "Unknown endpoint: 'xxxx"),
])
def test_malformed_requests_are_one_line_refusals(frame, says):
    with pytest.raises(RequestError) as info:
        protocol.parse_request(frame, api_token=None)
    msg = str(info.value)
    assert says in msg and "\n" not in msg and len(msg) <= protocol.MAX_ERROR_CHARS, msg


def test_an_error_reply_is_one_bounded_line():
    reply = msgpack.unpackb(protocol.error_reply("a\nb\r\n  c" + "x" * 5000))
    assert reply["error"].startswith("a b c") and len(reply["error"]) == protocol.MAX_ERROR_CHARS
    with pytest.raises(RequestError, match="^server error: boom$"):
        protocol.parse_reply(protocol.error_reply("boom"))


def test_arrays_round_trip_by_value_shape_dtype_and_order():
    for arr in (np.arange(24, dtype=np.int16).reshape(2, 3, 4), np.asfortranarray(np.ones((3, 2), np.float64)),
                np.zeros((0, 5), np.float32), np.array(True)):
        back = protocol.parse_reply(protocol.pack(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    with pytest.raises(TypeError):
        protocol.pack(np.array([object()]))
