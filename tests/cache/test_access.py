"""Who may talk to the daemon and whose files a client maps: socket and tier modes, stale and
squatted socket paths, tier-file ownership and hashes, IPv6 loopback. Real daemon processes."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager

import pytest

from loongforge.cache.access import check_socket_dir, make_private_dir
from loongforge.cache.client import CacheClient
from loongforge.cache.config import default_socket_path

from loongforge.cache.protocol import Connection
from loongforge.shared.errors import CacheError

from tests.cache.cache_helpers import wait_for
from tests.conftest import free_port

pytestmark = pytest.mark.slow
NOBODY = 65534
UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "cache", "loongforge-cache.service")


def _bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextmanager
def _as_nobody():
    """Act as another user (supplementary groups kept: root's group 0 = the daemon's group here)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another uid")
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


def _serve_args(root, tmp_path, *extra):
    return [sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--ram-dir", str(tmp_path / "ram"),
            "--ssd-dir", str(tmp_path / "ssd"), "--ram-budget", "1MiB", "--ssd-budget", "1MiB", *extra]


def test_socket_is_group_rw_and_tiers_are_not_world_readable(synthetic_root, daemons, tmp_path):
    root, index = synthetic_root
    sock_dir = tempfile.mkdtemp(prefix="lf-sock-")  # outside pytest's 0700 tmp: the group can reach it
    os.chmod(sock_dir, 0o750)
    try:
        d = daemons(root, index, start=False)
        d.args[d.args.index("--socket") + 1] = d.socket = os.path.join(sock_dir, "c.sock")
        d.start()  # started under the test's umask 022, which used to give the socket 0755
        assert _mode(d.socket) == 0o660
        with _as_nobody():  # a trainer of another user in the daemon's group can connect
            conn = Connection(d.socket, None, 5.0)
            assert conn.request("hello")["node"] == "node-a"
            conn.close()
        with d.client() as client:
            client.read_shard(index.shards[0].name)
        ram_file = os.path.join(d.ram_dir, "data", index.shards[0].name)
        assert _mode(ram_file) == 0o640
        for directory in (d.ram_dir, os.path.join(d.ram_dir, "data"), os.path.dirname(ram_file), d.ssd_dir):
            assert _mode(directory) == 0o750, directory
        assert _mode(os.path.join(d.ram_dir, ".lock")) == 0o640
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    with open(UNIT) as f:
        assert "UMask=0007" in f.read().splitlines()


def test_permission_denied_is_an_error_naming_the_socket_and_the_fix(synthetic_root, daemons, caplog):
    root, index = synthetic_root
    d = daemons(root, index)
    client = CacheClient(root, index, socket_path=d.socket)
    with caplog.at_level(logging.WARNING, logger="loongforge.cache.client"), _as_nobody():
        # nobody cannot reach the socket (pytest's tmp dir is 0700): every read would bypass the cache
        with pytest.raises(OSError):  # origin is unreadable for nobody too; the log is the point
            client.read_shard(index.shards[0].name)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors, caplog.text
    msg = errors[0].getMessage()
    assert d.socket in msg and "EACCES" in msg and "UMask=0007" in msg and "group" in msg
    client.close()


@pytest.mark.parametrize("squatter", ["regular file", "socket of another user"])
def test_bind_refuses_to_unlink_what_is_not_its_own_stale_socket(synthetic_root, tmp_path, squatter):
    root, _ = synthetic_root
    path = str(tmp_path / "c.sock")
    if squatter == "regular file":
        with open(path, "w") as f:
            f.write("precious")
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()  # a dead listener's socket file, but it belongs to uid 65534
        os.chown(path, NOBODY, NOBODY)
    out = subprocess.run(_serve_args(root, tmp_path, "--socket", path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "refusing to replace it" in out.stderr, out.stderr
    assert os.path.exists(path)
    if squatter == "regular file":
        assert open(path).read() == "precious"
    assert not os.path.exists(tmp_path / "ram")  # refused before touching any tier


def test_own_stale_socket_is_replaced(synthetic_root, tmp_path):
    root, index = synthetic_root
    path = str(tmp_path / "c.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    proc = subprocess.Popen(_serve_args(root, tmp_path, "--socket", path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert any("ready on" in line for line in proc.stdout), "daemon exited before it was ready"
        with CacheClient(root, index, socket_path=path) as client:
            assert bytes(client.read_shard(index.shards[0].name)) == _bytes(root, index.shards[0].name)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_default_socket_without_runtime_dir_is_in_a_private_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("LOONGFORGE_CACHE_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = default_socket_path()
    parent = os.path.dirname(path)
    assert parent == str(tmp_path / f"loongforge-cache-{os.geteuid()}")
    make_private_dir(parent)
    check_socket_dir(path)
    assert _mode(parent) == 0o700
    os.chmod(parent, 0o777)  # anyone could drop a socket in here now
    with pytest.raises(CacheError, match="planted"):
        check_socket_dir(path)


def test_daemon_refuses_a_squatted_default_socket_dir(synthetic_root, tmp_path):
    root, _ = synthetic_root
    squat = tmp_path / "tmp" / f"loongforge-cache-{os.geteuid()}"
    squat.mkdir(parents=True)
    os.chown(squat, NOBODY, NOBODY)  # another user created the per-uid dir first
    os.chmod(squat, 0o777)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "LOONGFORGE_CACHE_SOCKET")}
    env["TMPDIR"] = str(tmp_path / "tmp")
    out = subprocess.run(_serve_args(root, tmp_path), capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "planted" in out.stderr, out.stderr
    assert os.listdir(squat) == []


def _swap_tier_file(path: str, uid: int, mode: int) -> None:
    """Another user (or a bug) replaces a tier file by one of the same size with other bytes."""
    size = os.path.getsize(path)
    tmp = path + ".evil"
    with open(tmp, "wb") as f:
        f.write(b"\xee" * size)
    os.chown(tmp, uid, uid)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:  # in place: same owner, mode and size; only a hash can tell
        f.seek(700)
        byte = f.read(1)
        f.seek(700)
        f.write(bytes([byte[0] ^ 0xFF]))


# kind -> (over TCP, tamper(path)); the client checks mode, owner (the daemon's uid, from the kernel) and
# sha256 on every map, whichever the transport: a byte flipped in place by root or the daemon's uid keeps
# owner and mode, and used to reach every new reader over the unix socket
TAMPER = {
    "swapped, foreign owner": (False, lambda p: _swap_tier_file(p, NOBODY, 0o640)),
    "swapped, world-writable": (False, lambda p: _swap_tier_file(p, 0, 0o666)),
    "chmod o+w": (False, lambda p: os.chmod(p, 0o646)),
    "chmod g+w": (False, lambda p: os.chmod(p, 0o660)),
    "chown": (False, lambda p: os.chown(p, NOBODY, -1)),
    "swapped, same owner, over tcp": (True, lambda p: _swap_tier_file(p, os.geteuid(), 0o640)),
    "flipped byte, over tcp": (True, _flip_byte),
    "flipped byte, over the unix socket": (False, _flip_byte),
    "chmod g+w, over tcp": (True, lambda p: os.chmod(p, 0o660)),
}


@pytest.mark.parametrize("kind", list(TAMPER))
def test_refused_tier_file_is_reported_replaced_and_served_again(synthetic_root, daemons, kind):
    """The client refuses a tampered tier file and tells the daemon; the daemon checks the file itself
    (owner, mode, sha256), drops it and fills the shard again: this read and the next are served by
    the daemon, none from origin, and the event is one WARNING and a counter."""
    root, index = synthetic_root
    name = index.shards[0].name
    over_tcp, tamper = TAMPER[kind]
    tcp = f"127.0.0.1:{free_port()}" if over_tcp else None
    port = free_port()
    d = daemons(root, index, extra=("--metrics-port", str(port), *(("--tcp", tcp) if tcp else ())))
    endpoint = {"tcp": tcp} if tcp else {"socket_path": d.socket}

    def stats():
        with CacheClient(root, index, **endpoint) as c:
            return c.stats()["daemon"]

    with CacheClient(root, index, **endpoint) as first:
        first.read_shard(name)
    wait_for(lambda: stats()["ssd_pending"] == 0, what="ssd write-through")
    path = os.path.join(d.ram_dir, "data", name)
    tamper(path)
    for reader in ("the reporting reader", "the next reader"):
        with CacheClient(root, index, **endpoint) as client:
            assert bytes(client.read_shard(name)) == _bytes(root, name), reader
            assert client.counts["origin_reads"] == 0 and client.counts["daemon_reads"] == 1, (reader, client.counts)
    st = os.lstat(path)  # the fresh copy: the daemon's, not writable by others, the origin's bytes
    assert (st.st_uid, _mode(path), _bytes(os.path.dirname(path), name.split("/")[-1])) == \
        (os.geteuid(), 0o640, _bytes(root, name))
    after = stats()
    assert after["counters"]["reports"] == {"replaced": 1} and after["counters"]["corrupt"] == {"ram": 1}
    assert after["counters"]["fills"].get("origin") == 1  # refilled from the SSD copy, not origin
    warnings = [line for line in d.log().splitlines() if " WARNING " in line and "refused its copy" in line]
    assert len(warnings) == 1 and name in warnings[0], warnings
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loongforge_cache_reports_total{outcome="replaced"} 1.0' in metrics



def test_ipv6_loopback_endpoint(synthetic_root, daemons):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    root, index = synthetic_root
    port = free_port()
    d = daemons(root, index, extra=("--tcp", f"::1:{port}"))
    assert f"ready on tcp:[::1]:{port}" in d.log()
    with CacheClient(root, index, tcp=f"[::1]:{port}") as client:
        name = index.shards[1].name
        assert bytes(client.read_shard(name)) == _bytes(root, name) and not client.degraded


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["umask 000", "umask 077"])
def test_modes_hold_under_any_umask(synthetic_root, daemons, umask):
    """Whatever umask the daemon starts under, everything it creates gets its mode by chmod: the
    group reaches socket and tier files (077 used to leave data/shards 0700: every group read went to
    origin), and no directory it creates is world-writable (000 used to leave created parents 0777)."""
    root, index = synthetic_root
    name = index.shards[0].name
    expected = _bytes(root, name)
    base = tempfile.mkdtemp(prefix="lf-umask-")
    os.chmod(base, 0o750)  # the group (root's group: `nobody` below keeps it) may enter
    try:
        d = daemons(root, index, start=False, umask=umask)
        where = {"--socket": f"{base}/run/lf/c.sock", "--ram-dir": f"{base}/shm/lf", "--ssd-dir": f"{base}/ssd/deep/tier"}
        for flag, value in where.items():
            d.args[d.args.index(flag) + 1] = value
        d.socket, d.ram_dir, d.ssd_dir = where.values()
        d.start()
        with _as_nobody(), d.client(fallback=False) as client:  # a trainer of another user in the daemon's group
            assert bytes(client.read_shard(name)) == expected and client.counts["daemon_reads"] == 1
        wait_for(lambda: d.stats()["ssd_pending"] == 0, what="ssd write-through")
        assert _mode(d.socket) == 0o660
        dirs = [f"{base}/run", f"{base}/run/lf", f"{base}/shm", f"{base}/ssd", f"{base}/ssd/deep"]
        files = []
        for tier in (d.ram_dir, d.ssd_dir):
            dirs += [tier, f"{tier}/data", os.path.dirname(f"{tier}/data/{name}")]
            files += [f"{tier}/data/{name}", f"{tier}/.lock", f"{tier}/CACHE_FORMAT.json"]
        assert {p: oct(_mode(p)) for p in dirs} == {p: oct(0o750) for p in dirs}
        assert {p: oct(_mode(p)) for p in files} == {p: oct(0o640) for p in files}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_planted_socket_dir_is_refused_by_cli_as_by_the_client(synthetic_root, daemons, monkeypatch, caplog, request):
    """Another user planted the per-uid fallback socket directory and serves their own daemon in it
    (socket 0666): the client library refuses it, and so do `cache stats` and `cache stop`, with the
    same words, without printing its answers or stopping it."""
    root, index = synthetic_root
    tmpdir = tempfile.mkdtemp(prefix="lf-")  # short: the socket path must fit in sun_path
    request.addfinalizer(lambda: shutil.rmtree(tmpdir, ignore_errors=True))
    planted = os.path.join(tmpdir, f"loongforge-cache-{os.geteuid()}")
    os.mkdir(planted)
    d = daemons(root, index, start=False)  # the outsider's daemon: to it, an ordinary --socket directory
    d.args[d.args.index("--socket") + 1] = d.socket = os.path.join(planted, "cache.sock")
    d.start()
    os.chown(planted, NOBODY, NOBODY)  # as the outsider leaves it
    os.chmod(planted, 0o777)
    os.chmod(d.socket, 0o666)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("LOONGFORGE_CACHE_SOCKET", raising=False)
    monkeypatch.setenv("TMPDIR", tmpdir)
    assert default_socket_path() == d.socket
    with pytest.raises(CacheError) as refused:
        check_socket_dir(d.socket)
    words = str(refused.value)
    assert "planted" in words
    with caplog.at_level(logging.WARNING, logger="loongforge.cache.client"):
        with CacheClient(root, index) as client:  # the default socket path
            assert bytes(client.read_shard(index.shards[0].name)) == _bytes(root, index.shards[0].name)
            assert client.counts["origin_reads"] == 1 and client.counts["daemon_reads"] == 0
    assert any(words in r.getMessage() for r in caplog.records), caplog.text
    for action in ("stats", "stop"):
        out = subprocess.run([sys.executable, "-m", "loongforge.cache", action], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ))
        assert out.returncode == 1 and out.stdout == "" and words in out.stderr, (action, out.stdout, out.stderr)
    assert d.proc.poll() is None  # `cache stop` never reached the planted daemon
    assert d.stats()["counters"]["fills"] == {}  # nothing the client asked for was filled by it


@contextmanager
def _throwaway_group():
    if os.geteuid() != 0 or not shutil.which("groupadd"):
        pytest.skip("needs root and groupadd to create a throwaway group")
    name = f"lf-test-{os.getpid()}"
    subprocess.run(["groupadd", name], check=True, capture_output=True, timeout=30)
    try:
        yield name, grp.getgrnam(name).gr_gid
    finally:
        subprocess.run(["groupdel", name], capture_output=True, timeout=30)


@contextmanager
def _as_outsider():
    """Another user in none of the daemon's groups."""
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def test_permission_denied_names_the_socket_group(synthetic_root, daemons, caplog):
    root, index = synthetic_root
    sock_dir = tempfile.mkdtemp(prefix="lf-sock-")
    os.chmod(sock_dir, 0o755)  # anyone reaches the socket; only its group may connect
    try:
        with _throwaway_group() as (group, gid):
            d = daemons(root, index, start=False)
            d.args[d.args.index("--socket") + 1] = d.socket = os.path.join(sock_dir, "c.sock")
            d.start()
            os.chown(d.socket, -1, gid)  # the daemon's group (systemd's Group=, the DaemonSet's runAsGroup)
            client = CacheClient(root, index, socket_path=d.socket)
            with caplog.at_level(logging.WARNING, logger="loongforge.cache.client"), _as_outsider():
                with pytest.raises(OSError):  # origin is unreadable for the outsider too; the log is the point
                    client.read_shard(index.shards[0].name)
            client.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "EACCES" in errors[0] and f"group, {group} (gid {gid})" in errors[0], caplog.text


def test_socket_dir_check_outside_the_fallback_dir(tmp_path):
    """An explicit socket directory is trusted only if no one but its owner may write it: a sticky
    /tmp-like directory (1777) lets anyone take the socket's name before the daemon starts."""
    d = tmp_path / "run"
    d.mkdir()
    for mode, trusted in ((0o750, True), (0o755, True), (0o1777, False), (0o777, False), (0o770, False)):
        os.chmod(d, mode)
        if trusted:
            assert check_socket_dir(str(d / "c.sock")) == os.geteuid()  # the uid the daemon must have: the owner's
        else:
            with pytest.raises(CacheError, match="anyone could replace the socket"):
                check_socket_dir(str(d / "c.sock"))
    os.chmod(d, 0o750)
    os.symlink(d, tmp_path / "link")
    with pytest.raises(CacheError, match="symlink"):
        check_socket_dir(str(tmp_path / "link" / "c.sock"))
