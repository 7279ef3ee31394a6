"""The elastic supervisor's fork server (train/resilience/elastic/forks.py), with real processes: a server
(fork_server.py, the real ForkServer with a light entry instead of the trainer) and stand-ins started as
torchrun starts ranks. The rank it forks takes the stand-in's argv, environment, working directory and
stdio, shows them in /proc, and its exit is the stand-in's; signals reach it, a killed stand-in takes it
along, a stopped one stops it; a refused fork or no server is a plain `python -m` in the stand-in's
process. The supervisor's use of it runs in every elastic test (test_stop.py, test_multinode.py, ...)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongforge.train.resilience import owner
from loongforge.train.resilience.elastic import forks

REPO = Path(__file__).resolve().parents[3]
SERVER = Path(__file__).with_name("fork_server.py")
MAIN = "tests.train.resilience.fork_main"
ROOM = "." * forks.ROOM_BYTES


@pytest.fixture
def server(tmp_path):
    yield from _server(tmp_path)


@pytest.fixture
def busy_server(tmp_path):
    yield from _server(tmp_path, "--thread")


def _server(tmp_path, *flags):
    path = str(tmp_path / "s")  # AF_UNIX paths are short: tmp_path is
    proc = subprocess.Popen([sys.executable, str(SERVER), path, *flags, "--room", ROOM], cwd=REPO,
                            env={**os.environ, forks.ROOM_ENV: ROOM}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield path, proc
    proc.kill()
    proc.wait()


def stand_in(path: str, argv: list[str], cwd, **env) -> subprocess.Popen:
    """A stand-in as torchrun would start it: its own argv, environment and pipes."""
    code = f"import sys; from loongforge.train.resilience.elastic.forks import stand_in; stand_in({MAIN!r}, sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), forks.WARM_ENV: path, **env})


def _first(proc) -> dict:
    return json.loads(proc.stdout.readline())


def _until(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _proc(pid: int, what: str) -> list[bytes]:
    with open(f"/proc/{pid}/{what}", "rb") as f:
        return f.read().split(b"\0")


def test_the_forked_rank_has_the_stand_ins_argv_env_cwd_and_exit_code(server, tmp_path):
    path, srv = server
    p = stand_in(path, ["exit", "7"], tmp_path, RANK="3")
    doc = _first(p)
    p.wait(timeout=30)
    assert p.returncode == 7
    assert doc["ppid"] == srv.pid and doc["pid"] != p.pid  # forked by the server, not run in the stand-in
    assert doc["argv"][1:] == ["exit", "7"] and doc["argv"][0].endswith("fork_main.py")
    assert doc["cwd"] == str(tmp_path) and doc["rank"] == "3" and doc["main"] == MAIN


def test_a_spawned_worker_of_the_rank_imports_the_ranks_main_module(server, tmp_path):
    path, _ = server
    p = stand_in(path, ["spawn"], tmp_path)
    _first(p)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"mp_main": MAIN}  # not fork_server.py's


def test_proc_shows_the_rank_as_its_stand_in_was_and_signals_reach_it(server, tmp_path):
    path, _ = server
    p = stand_in(path, ["sleep", str(tmp_path)], tmp_path, RANK="1", LOONGFORGE_MARK="x")
    rank = _first(p)["pid"]
    assert _until(lambda: _proc(p.pid, "cmdline")[:2] == [b"loongforge.train", b"stand-in"])
    cmd, env = _proc(rank, "cmdline"), _proc(rank, "environ")
    assert cmd[:4] == [sys.executable.encode(), b"-u", b"-m", MAIN.encode()] and str(tmp_path).encode() in cmd
    assert b"RANK=1" in env and b"LOONGFORGE_MARK=x" in env and forks.ROOM_ENV.encode() not in b"".join(env)
    assert owner.rank_pids(os.getpid()) == [p.pid]  # what the supervisor forwards its signals to: the stand-in
    p.send_signal(signal.SIGTERM)  # forwarded
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 85 and "term" in out


def test_a_killed_stand_in_takes_its_rank_along(server, tmp_path):
    path, _ = server
    p = stand_in(path, ["sleep"], tmp_path)
    rank = _first(p)["pid"]
    p.kill()
    p.wait()
    assert _until(lambda: owner.proc_state(rank) in (None, "Z"), 5.0)


def test_stops_are_mirrored_and_a_killed_rank_kills_its_stand_in_with_the_same_signal(server, tmp_path):
    path, _ = server
    p = stand_in(path, ["sleep"], tmp_path)
    rank = _first(p)["pid"]
    p.send_signal(signal.SIGSTOP)
    assert _until(lambda: owner.proc_state(rank) == "T", 5.0)
    p.send_signal(signal.SIGCONT)
    assert _until(lambda: owner.proc_state(rank) not in ("T", None), 5.0)
    os.kill(rank, signal.SIGKILL)  # the rank itself (what the fault tools find by its command line)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL  # torchrun sees the rank's signal


def test_a_refused_fork_and_a_missing_server_start_the_rank_plain_in_the_stand_in(busy_server, tmp_path):
    path, _ = busy_server
    for where in (path, str(tmp_path / "none")):
        p = stand_in(where, ["exit", "5"], tmp_path)
        doc = _first(p)
        p.wait(timeout=60)
        assert p.returncode == 5 and doc["pid"] == p.pid  # exec'd in place: the stand-in is the rank
        assert doc["main"] == MAIN and os.environ.get(forks.WARM_ENV) is None


def test_the_ranks_stop_when_the_server_dies(server, tmp_path):
    path, srv = server
    p = stand_in(path, ["sleep"], tmp_path)
    rank = _first(p)["pid"]
    srv.kill()  # what the supervisor's death does to it (PDEATHSIG)
    out, _ = p.communicate(timeout=30)
    assert "term" in out  # the rank's SIGTERM, as from a launcher that died (owner.py)
    assert p.returncode == 1 and owner.proc_state(rank) in (None, "Z")


def test_the_server_outlives_every_malformed_request(server, tmp_path):
    """The fork server's wire (length-prefixed JSON, descriptors on the first message): garbage, a short
    message, a huge length, no descriptors, an unknown entry, a client gone mid-message. Each is refused
    (a one-line reason where the client still listens) and the next good request is served."""
    import random
    import socket

    path, srv = server
    rng = random.Random(0)
    with open(os.devnull, "r+b") as null:
        fds = [null.fileno()] * 3
        bodies = [b"", b"\x00", b"\xff\xff\xff\xff", forks._HEADER.pack(10) + b"{", forks._HEADER.pack(2) + b"[]",
                  *(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(20))]
        for i, body in enumerate(bodies):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(20)
                c.connect(path)
                if body and i % 2:
                    socket.send_fds(c, [body], fds)
                elif body:
                    c.sendall(body)
                c.shutdown(socket.SHUT_WR)
                reply, _ = forks._recv(c)
                assert reply is None or "refused" in reply, (body, reply)
        with pytest.raises(forks.Refused, match="malformed request"):
            forks.spawn(path, "nope", [], env={}, cwd=str(tmp_path), fds=tuple(fds))
    assert srv.poll() is None
    p = stand_in(path, ["exit", "4"], tmp_path)
    assert _first(p)["ppid"] == srv.pid and p.wait(timeout=30) == 4  # still forking
