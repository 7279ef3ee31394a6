"""`loongforge serve` on a trained tiny run, in its own process, over real TCP: the actions equal
Policy.predict_action's (and eval's) for the same observation, seeds and checkpoint, through a client
written here from the documented wire format alone; 1,000+ malformed requests each get a one-line
error and leave it serving; Isaac-GR00T's own PolicyClient works against it unmodified (given a
checkout of Isaac-GR00T); SIGTERM stops it cleanly; another address needs a private token."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import subprocess
import sys
import threading
import time
import types

import msgpack
import numpy as np
import pytest
import torch
import zmq

from tests.outside import fixture_dir
from tests.train.train_launch import assert_ok, launch, launch_env

pytestmark = pytest.mark.slow
LANG = "annotation.human.action.task_description"
STATE = {"arm": (0, 5), "gripper": (5, 6)}
ACTION = {"arm": (0, 3), "gripper": (3, 4)}
H = W = 16
K = 2  # --video-deltas=-1,0
TOKEN = "serve-test-token-0123456789abcdef"
FUZZ = 1200


def write_root(root: str) -> None:
    """Two cameras, state and action in modality.json groups, min/max statistics (so un-normalising
    is visible in the actions)."""
    from loongforge.shared.synthetic import synthetic_dataset_info, synthetic_episode
    from loongforge.shared.writer import RootWriter

    info = synthetic_dataset_info(H, W, ("front", "wrist"), 6, 4, 4)
    group = lambda spans: {k: {"start": a, "end": b} for k, (a, b) in spans.items()}  # noqa: E731
    info = dataclasses.replace(info, modality={"state": group(STATE), "action": group(ACTION)}, stats={
        "state": {"min": [-2.0] * 6, "max": [2.0] * 6, "mean": [0.0] * 6, "std": [1.0] * 6},
        "action": {"min": [-1.5, -1.0, 0.0, 0.0], "max": [1.5, 3.0, 1.0, 1.0], "mean": [0.0] * 4, "std": [1.0] * 4}})
    w = RootWriter(root, info, block_size=4, shard_size=1 << 16, params={"synthetic": True}, created_by="test")
    for ep, n in enumerate((12, 10)):
        frames, arrays = synthetic_episode(ep, n, H, W, ("front", "wrist"), 6, 4, 0)
        w.add_episode(ep, frames, arrays)
    w.close(val_episodes=())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    root, run = str(work / "shards"), str(work / "run")
    write_root(root)
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", run, "--recipe", "tiny",
                      "--steps", "2", "--batch-size", "4", "--workers", "1", "--device", "cpu", "--seed", "3",
                      "--video-deltas=-1,0", "--no-ds-breakdown"], cwd=str(work), timeout=300))
    token = work / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return root, run, str(token)


class Served:
    """`loongforge serve` in a child process; `port` once it says where it listens."""

    def __init__(self, args: list[str], cwd: str):
        self.log = open(os.path.join(cwd, f"serve-{time.monotonic_ns()}.log"), "w+")
        env = launch_env()  # one OpenMP thread, CUDA hidden: the numerics of the reference below
        self.proc = subprocess.Popen([sys.executable, "-m", "loongforge", "serve", *args, "--port", "0"], cwd=cwd,
                                     env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 180
        while not any(" on tcp://" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve did not start (rc={self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.1)
        line = next(line for line in self.lines if " on tcp://" in line)
        self.port = int(line.split(" on tcp://")[1].split()[0].rsplit(":", 1)[1])

    def tail(self) -> str:
        self.log.seek(0)
        return "".join(self.lines)[-2000:] + self.log.read()[-4000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"serve still running {timeout} s later:\n{self.tail()}")


@pytest.fixture(scope="module")
def server(tiny_run, tmp_path_factory):
    root, run, token = tiny_run
    s = Served([run, "--api-token-file", token], cwd=str(tmp_path_factory.mktemp("served")))  # no --data needed
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.fixture(scope="module")
def policy(tiny_run):
    from loongforge.train.eval.policy import Policy

    root, run, _ = tiny_run
    return Policy.load(run, root)


# ---- a client written from the documented wire format only (not loongforge's protocol module) ----


def _npy(arr: np.ndarray) -> dict:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return {"__ndarray_class__": True, "as_npy": buf.getvalue()}


def _hook(obj):
    if isinstance(obj, dict) and "__ndarray_class__" in obj:
        return np.load(io.BytesIO(obj["as_npy"]), allow_pickle=False)
    return obj


class Wire:
    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frame: bytes | list[bytes]):
        if isinstance(frame, list):
            self.sock.send_multipart(frame)
        else:
            self.sock.send(frame)
        return msgpack.unpackb(self.sock.recv(), object_hook=_hook)

    def call(self, endpoint: str, data=None, token: str | None = TOKEN):
        request = {"endpoint": endpoint}
        if data is not None:
            request["data"] = data
        if token:
            request["api_token"] = token
        return self.send(msgpack.packb(request, default=lambda o: _npy(o) if isinstance(o, np.ndarray) else o))

    def close(self):
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def wire(server):
    w = Wire(server.port)
    yield w
    w.close()


def observation(b: int, seed: int) -> dict:
    """A GR00T-layout observation of B samples: video [B, T, H, W, 3] uint8, state [B, T, D] float32."""
    rng = np.random.default_rng(seed)
    return {"video": {cam: rng.integers(0, 256, (b, K, H, W, 3), dtype=np.uint8) for cam in ("front", "wrist")},
            "state": {key: rng.uniform(-2, 2, (b, K, e - s)).astype(np.float32) for key, (s, e) in STATE.items()},
            "language": {LANG: [[("pick the cube", "open the drawer")[i % 2]] for i in range(b)]}}


def offline(policy, obs: dict, **kw) -> dict[str, np.ndarray]:
    """Policy.predict_action of the same observation, per action key (one thread, as the server)."""
    b = len(obs["language"][LANG])
    rows = [{"frames": {cam: obs["video"][cam][i] for cam in ("front", "wrist")},
             "state": np.concatenate([obs["state"][k][i] for k in STATE], axis=-1),
             "task": obs["language"][LANG][i][0]} for i in range(b)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = policy.predict_action(rows, **kw)
    finally:
        torch.set_num_threads(threads)
    return {key: out[..., s:e] for key, (s, e) in ACTION.items()}


# ---- the tests ----


def test_get_action_over_tcp_equals_predict_action(wire, policy):
    from loongforge.train.eval.openloop import predict_chunks

    for b, options, kw in ((1, None, {}), (3, {"seed": 11, "samples": 2, "steps": 3}, {"seed": 11, "samples": 2,
                                                                                        "steps": 3})):
        obs = observation(b, seed=b)
        action, info = wire.call("get_action", {"observation": obs, "options": options})
        want = offline(policy, obs, **kw)
        assert sorted(action) == sorted(ACTION)
        for key, (s, e) in ACTION.items():
            assert action[key].dtype == np.float32 and action[key].shape == (b, policy.cfg.action_horizon, e - s)
            assert np.array_equal(action[key], want[key]), key
        assert info == {"steps": kw.get("steps", 4), "samples": kw.get("samples", 8), "seed": kw.get("seed", 0)}
    # what `loongforge eval` computes for a batch (its K-sample column) is the same numbers
    rows = [{"frames": {c: obs["video"][c][i] for c in ("front", "wrist")}, "task": obs["language"][LANG][i][0],
             "state": np.concatenate([obs["state"][k][i] for k in STATE], -1)} for i in range(b)]
    torch.set_num_threads(1)
    batch, raw = policy.batch(rows)
    batch["raw_state"] = torch.from_numpy(raw)
    chunks = predict_chunks(policy, batch, steps=3, seed=11, samples=2, cameras=["front", "wrist"])["policy_k"]
    assert np.array_equal(np.concatenate([action[k] for k in ACTION], -1), chunks)
    # un-normalised: the gripper's training range is [0, 1], the arm's second dim [-1, 3]
    assert action["gripper"].min() >= 0.0 and action["arm"][..., 1].max() <= 3.0


def test_loongforges_client(server, policy):
    from loongforge.shared.errors import RequestError
    from loongforge.train.serve.client import PolicyClient

    with PolicyClient("127.0.0.1", server.port, api_token=TOKEN) as client:
        assert client.ping()
        config = client.get_modality_config()
        assert config["video"]["modality_keys"] == ["front", "wrist"] and config["video"]["delta_indices"] == [-1, 0]
        assert config["state"]["modality_keys"] == list(STATE) and config["action"]["modality_keys"] == list(ACTION)
        assert config["action"]["delta_indices"] == list(range(policy.cfg.action_horizon))
        assert config["language"]["modality_keys"] == [LANG]
        assert client.reset() == {}
        obs = observation(2, seed=5)
        action, _ = client.get_action(obs, {"samples": 1})
        want = offline(policy, obs, samples=1)
        assert all(np.array_equal(action[k], want[k]) for k in ACTION)
        with pytest.raises(RequestError, match=r"observation\['video'\]\['wrist'\] missing"):
            client.get_action({**obs, "video": {"front": obs["video"]["front"]}})
    with PolicyClient("127.0.0.1", server.port, api_token="wrong-token-0123456789") as client:
        with pytest.raises(RequestError, match="^server error: Unauthorized: Invalid API token$"):
            client.get_action(obs)


def pick(rng: np.random.Generator, options: list):
    return options[int(rng.integers(len(options)))]


def malformed(rng: np.random.Generator, valid: dict) -> tuple[bytes | list[bytes], str]:
    """One malformed request (a frame, or several) and a piece of the error line it must get."""
    obs = valid["observation"]
    pack = lambda req: msgpack.packb(req, default=lambda o: _npy(o) if isinstance(o, np.ndarray) else o)  # noqa: E731
    good = pack({"endpoint": "get_action", "data": valid, "api_token": TOKEN})
    with_obs = lambda o, **kw: pack({"endpoint": "get_action", "data": {"observation": o, **kw},  # noqa: E731
                                     "api_token": TOKEN})
    cam, key = pick(rng, ["front", "wrist"]), pick(rng, list(STATE))
    v, s = obs["video"][cam], obs["state"][key]
    kind = int(rng.integers(0, 24))
    if kind == 0:
        return good[: int(rng.integers(0, len(good)))], "malformed msgpack"
    if kind == 1:
        return rng.bytes(int(rng.integers(0, 300))), ""  # anything but a valid request
    if kind == 2:
        return with_obs({**obs, "video": {c: x for c, x in obs["video"].items() if c != cam}}), f"['{cam}'] missing"
    if kind == 3:
        return with_obs({**obs, "state": {k: x for k, x in obs["state"].items() if k != key}}), f"['{key}'] missing"
    if kind == 4:
        bad = v.astype(pick(rng, [np.float32, np.float64, np.int16, np.int64]))
        return with_obs({**obs, "video": {**obs["video"], cam: bad}}), "expected uint8 RGB"
    if kind == 5:  # another frame count or channel count (any image size is taken: the processor resizes)
        shape = list(v.shape)
        shape[pick(rng, [1, 4])] += int(rng.integers(1, 4))
        return with_obs({**obs, "video": {**obs["video"], cam: np.zeros(shape, np.uint8)}}), \
            "expected uint8 RGB 0-255 [B, T, H, W, 3]"
    if kind == 6:
        return with_obs({**obs, "video": {**obs["video"], cam: v[0]}}), f"['{cam}']"
    if kind == 7:
        bad = s.astype(pick(rng, [np.float64, np.float16, np.int32]))
        return with_obs({**obs, "state": {**obs["state"], key: bad}}), "expected float32 [B, T, D]"
    if kind == 8:
        d = STATE[key][1] - STATE[key][0]
        return with_obs({**obs, "state": {**obs["state"], key: np.zeros((1, K, d + 1), np.float32)}}), \
            f"of shape [1, {K}, {d}]"
    if kind == 9:
        return with_obs({**obs, "state": {**obs["state"], key: s.tolist()}}), "expected an ndarray"
    if kind == 10:
        return with_obs({**obs, "language": {LANG: pick(rng, ["pick", ["pick"], [[1]], [[]], [["a", "b"]], None])}}), \
            "instruction string"
    if kind == 11:
        return with_obs({**obs, "language": {}}), f"['{LANG}'] missing"
    if kind == 12:
        return pack({"endpoint": pick(rng, ["get_actions", "shutdown", "", "KILL"]), "api_token": TOKEN}), \
            "Unknown endpoint"
    if kind == 13:
        return pack({"endpoint": "get_action", "data": valid, "api_token": pick(rng, ["nope", TOKEN[:-1], 7])}), \
            "Unauthorized: Invalid API token"
    if kind == 14:
        return pack({"endpoint": "get_action", "data": valid}), "Unauthorized"
    if kind == 15:
        opts = pick(rng, [{"steps": 0}, {"samples": 10_000}, {"seed": -1}, {"steps": "4"}, {"temperature": 1.0},
                           {"samples": True}, [1]])
        return with_obs(obs, options=opts), "options"
    if kind == 16:
        two = {c: np.concatenate([x, x]) for c, x in obs["video"].items()}
        return with_obs({**obs, "video": two}), "batch sizes differ"
    if kind == 17:
        nan = s.copy()
        nan.flat[int(rng.integers(0, nan.size))] = pick(rng, [np.nan, np.inf, -np.inf])
        return with_obs({**obs, "state": {**obs["state"], key: nan}}), "NaN or infinity"
    if kind == 18:
        return [good, good], "one frame"
    if kind == 19:
        arr = _npy(v)
        arr["as_npy"] = arr["as_npy"][: int(rng.integers(0, len(arr["as_npy"])))]
        return with_obs({**obs, "video": {**obs["video"], cam: arr}}), ""
    if kind == 20:
        return with_obs(pick(rng, [None, [], "obs", 3])), "must be a map"
    if kind == 21:
        return pack(pick(rng, [[], "get_action", 1, None, b"\x00"])), "a request is a msgpack map"
    if kind == 22:
        b = 65
        return with_obs({**obs, "video": {c: np.zeros((b, *x.shape[1:]), np.uint8) for c, x in obs["video"].items()},
                         "state": {k: np.zeros((b, *x.shape[1:]), np.float32) for k, x in obs["state"].items()},
                         "language": {LANG: [["x"]] * b}}), "send 1 to 64"
    flipped = bytearray(good[:40])
    flipped[int(rng.integers(0, 40))] ^= 0xFF
    return bytes(flipped), ""  # a corrupted head (the rest cut): never a whole valid request


def test_a_thousand_malformed_requests_leave_it_serving(server, wire, policy):
    obs = observation(1, seed=7)
    valid = {"observation": obs, "options": {"samples": 1}}
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(FUZZ):
        frame, says = malformed(rng, valid)
        reply = wire.send(frame)
        assert isinstance(reply, dict) and list(reply) == ["error"], (i, reply)
        line = reply["error"]
        assert says in line and "\n" not in line and len(line) <= 300 and "Traceback" not in line, (i, says, line)
        seen.add(line.split(":")[0])
    assert len(seen) > 15  # many different refusals, not one error for everything
    assert server.proc.poll() is None
    assert wire.call("ping") == {"status": "ok", "message": "Server is running"}
    action, _ = wire.call("get_action", valid)
    want = offline(policy, obs, samples=1)  # a Policy loaded fresh from the checkpoint in this process
    assert all(np.array_equal(action[k], want[k]) for k in ACTION)


def test_isaac_gr00ts_own_policy_client(server, policy, monkeypatch):
    """Isaac-GR00T's PolicyClient, unmodified, from a checkout (LOONGFORGE_ISAAC_GR00T, or
    ../shared/fixtures/isaac_gr00t). Only gr00t/policy/__init__.py is skipped: it imports the model."""
    checkout = os.environ.get("LOONGFORGE_ISAAC_GR00T") or str(fixture_dir("isaac_gr00t"))
    pkg = types.ModuleType("gr00t.policy")
    pkg.__path__ = [os.path.join(checkout, "gr00t", "policy")]
    monkeypatch.syspath_prepend(checkout)
    monkeypatch.setitem(sys.modules, "gr00t.policy", pkg)
    from gr00t.data.types import ModalityConfig
    from gr00t.policy.server_client import PolicyClient

    client = PolicyClient(host="127.0.0.1", port=server.port, api_token=TOKEN)
    assert client.ping()
    config = client.get_modality_config()
    assert all(isinstance(c, ModalityConfig) for c in config.values())
    assert config["video"].modality_keys == ["front", "wrist"] and config["state"].delta_indices == [-1, 0]
    acts = config["action"].action_configs  # None: every key absolute (Isaac-GR00T's default)
    assert acts is None or acts[0].rep.name == "ABSOLUTE"
    obs = observation(2, seed=9)
    action, info = client.get_action(obs, options={"samples": 2})
    want = offline(policy, obs, samples=2)
    assert all(np.array_equal(action[k], want[k]) for k in ACTION) and info["samples"] == 2
    assert client.reset() == {}
    with pytest.raises(RuntimeError, match=r"^Server error: observation\['state'\]\['arm'\]: dtype float64"):
        client.get_action({**obs, "state": {**obs["state"], "arm": obs["state"]["arm"].astype(np.float64)}})


def test_sigterm_stops_it_cleanly(server, wire):
    """Last of the module's server tests: SIGTERM ends the loop after the request in hand, the process
    exits 0 (the `kill` endpoint ends the same loop: test_server_parts.py)."""
    assert wire.call("ping")["status"] == "ok"
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0, server.tail()
    assert "loongforge serve: stopped" in "".join(server.lines)
    assert "Traceback" not in server.tail()


@pytest.mark.parametrize("argv, mode, says", [
    (["--host", "0.0.0.0"], None, "--host 0.0.0.0 is not loopback"),
    (["--host", "0.0.0.0", "--api-token-file", "TOKEN"], 0o644, "no one else can read"),
    (["--api-token-file", "TOKEN"], 0o600, "at least 16 are needed"),
    (["--samples", "0"], None, "--samples 0: between 1 and 64"),
])
def test_refusals_at_start_are_one_line(tiny_run, tmp_path, argv, mode, says):
    root, run, _ = tiny_run
    token = tmp_path / "token"
    token.write_text("short\n" if "at least" in says else TOKEN)
    token.chmod(mode or 0o600)
    argv = [str(token) if a == "TOKEN" else a for a in argv]
    proc = launch([sys.executable, "-m", "loongforge", "serve", run, *argv], cwd=str(tmp_path), timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(err) == 1 and says in err[0], proc.stderr


def test_an_exported_directory_serves_the_runs_actions(tiny_run, tmp_path):
    """`loongforge export` of the run, served from the export (its own config, weights, processor files)."""
    from loongforge.train.ckpt.export import export_run
    from loongforge.train.serve.backend import load_backend

    root, run, _ = tiny_run
    export_run(run, str(tmp_path / "export"))
    from_run, from_export = load_backend(run), load_backend(str(tmp_path / "export"))
    assert from_export.get_modality_config() == from_run.get_modality_config()
    obs = observation(2, seed=4)
    a, _ = from_run.run(from_run.prepare(obs, {"samples": 2}))
    b, _ = from_export.run(from_export.prepare(obs, {"samples": 2}))
    for key in ACTION:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-2, atol=1e-2)  # bf16-exported frozen tensors, if any
