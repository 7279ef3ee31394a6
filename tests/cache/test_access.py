"""Who may talk to the daemon and whose files a client maps: socket and tier modes, stale and
squatted socket paths, tier-file ownership and hashes, IPv6 loopback. Real daemon processes."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import pytest

from loongforge.cache.client import CacheClient
from loongforge.cache.config import default_socket_path
from loongforge.cache.protocol import Connection
from loongforge.shared.errors import CacheError

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
    from loongforge.cache.config import check_private_dir

    monkeypatch.delenv("LOONGFORGE_CACHE_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = default_socket_path()
    parent = os.path.dirname(path)
    assert parent == str(tmp_path / f"loongforge-cache-{os.geteuid()}")
    check_private_dir(parent, create=True)
    assert _mode(parent) == 0o700
    os.chmod(parent, 0o777)  # anyone could drop a socket in here now
    with pytest.raises(CacheError, match="planted"):
        check_private_dir(parent)


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


@pytest.mark.parametrize("uid,mode", [(NOBODY, 0o640), (0, 0o666)], ids=["foreign owner", "world-writable"])
def test_client_refuses_a_tier_file_the_daemon_does_not_own(synthetic_root, daemons, uid, mode):
    root, index = synthetic_root
    name = index.shards[0].name
    d = daemons(root, index)
    path = Connection(d.socket, None, 5.0).request("get", shard=name)["path"]  # connection closes: pin dropped
    _swap_tier_file(path, uid, mode)
    with d.client() as client:
        assert bytes(client.read_shard(name)) == _bytes(root, name)  # the origin's bytes, not the swapped ones
        assert client.counts["origin_reads"] == 1


def test_tcp_client_hashes_a_tier_file_on_first_map(synthetic_root, daemons):
    root, index = synthetic_root
    name = index.shards[0].name
    tcp = f"127.0.0.1:{free_port()}"
    daemons(root, index, extra=("--tcp", tcp))
    with CacheClient(root, index, tcp=tcp) as client:
        path = client._request("get", shard=name)["path"]
    _swap_tier_file(path, os.geteuid(), 0o640)  # same owner, same size: only the hash can tell
    with CacheClient(root, index, tcp=tcp) as client:
        assert bytes(client.read_shard(name)) == _bytes(root, name)
        assert client.counts["origin_reads"] == 1


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
