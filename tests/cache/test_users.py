"""The daemon's access rules with real Unix users, set up as an outside audit set them up (users.py):
`d` runs the daemon, `inn` is in its group, `out` is not. `inn` and `out` share a primary group, as
users of one node often share `users`, so `out`'s own daemon is one `inn` could read.
Each test is a finding of that audit: who may pose as the daemon, who may stop it, what a refused
user is told, a squatted RAM directory, and what a group member may change under a reader."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from loongforge.cache.access import peer_uid
from loongforge.cache.client import CacheClient
from tests.cache.cache_helpers import DaemonProc, counter, wait_for
from tests.cache.users import acting_as, public_copy, public_dir
from tests.conftest import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def world(users, synthetic_root):
    """A public base directory with a copy of the shard root every user may read, and a factory of
    daemons run as any of the users (each in a directory of its own under the base)."""
    with public_dir() as base:
        started: list[DaemonProc] = []

        def daemon(user, name="node-a", start=True, **kw) -> DaemonProc:
            d = DaemonProc(Path(base), world.root, world.index, name, user=user, **kw)
            started.append(d)
            return d.start() if start else d

        world = SimpleNamespace(base=base, root=public_copy(synthetic_root[0], base), index=synthetic_root[1],
                                u=users, daemon=daemon)
        yield world
        for d in started:
            if d.proc is not None:
                d.stop(signal.SIGKILL)


def _set(d: DaemonProc, flag: str, value: str) -> None:
    d.args[d.args.index(flag) + 1] = value
    if flag == "--socket":
        d.socket = value


def _refused_at_start(argv: list[str]) -> subprocess.CompletedProcess:
    """Run `serve`, which must exit at start; a daemon that starts instead is stopped and fails the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the daemon started where it must refuse to:\n{out}{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if " INFO " not in line and " DEBUG " not in line and line.strip()]
    assert len(lines) == 1 and lines[0].startswith("loongforge cache: error: ") and "Traceback" not in err, err
    return lines[0]


def _read_as(user, world, **endpoint) -> tuple[bytes, dict, list[str]]:
    """One read of shard 0 by `user` through the client library: (bytes, counts, its ERROR lines)."""
    name = world.index.shards[0].name
    handler = _Errors()
    logging.getLogger("loongforge.cache.client").addHandler(handler)
    try:
        with acting_as(user), CacheClient(world.root, world.index, **endpoint) as client:
            data = bytes(client.read_shard(name))
            counts = dict(client.counts)
    finally:
        logging.getLogger("loongforge.cache.client").removeHandler(handler)
    return data, counts, handler.errors


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record):
        self.errors.append(record.getMessage())


def _why(error: str) -> str:
    """The refusal in a client ERROR, without the client's "; reading shards from origin ..." tail."""
    return error.split("; reading shards from origin")[0]


def _origin_bytes(world) -> bytes:
    return Path(world.root, world.index.shards[0].name).read_bytes()


# -- who may pose as the daemon --------------------------------------------------------------------------
def test_daemon_refuses_a_socket_directory_another_user_owns(world):
    """`out` made /some/dir/lfrun (1777) before the daemon started there: the daemon used to bind in
    it (sticky, so "safe"), after which `out` could rename its socket away and serve its own."""
    u = world.u
    lfrun = os.path.join(world.base, "lfrun")
    os.mkdir(lfrun)
    os.chown(lfrun, u.out.uid, u.out.gid)
    os.chmod(lfrun, 0o1777)
    d = world.daemon(u.d, start=False)
    _set(d, "--socket", os.path.join(lfrun, "cache.sock"))
    out = _refused_at_start(d.args)
    line = _one_error_line(out.stderr)
    assert out.returncode == 1 and lfrun in line and f"owner uid {u.out.uid}" in line, line
    assert os.listdir(lfrun) == [] and not os.path.exists(d.ram_dir)  # nothing created, in there or anywhere


@pytest.mark.parametrize("where", ["in the other user's 1777 directory", "in root's sticky directory"])
def test_client_refuses_a_socket_directory_others_may_write(world, where):
    """`out` serves its own daemon where `inn` looks for the cache: in a directory of its own opened to
    everyone (1777), or in a root-owned sticky one like /tmp. `inn`'s client used to read `out`'s files
    (its owner check compared them with whoever answered); now it refuses the directory, says why in
    an ERROR and reads origin, and `cache stats` refuses with the same words."""
    u = world.u
    squatter = world.daemon(u.out, "squatter")
    if where.startswith("in the other"):
        os.chmod(squatter.dir, 0o1777)  # as `out` may, once its daemon listens
        sock = squatter.socket
    else:
        sticky = os.path.join(world.base, "tmp")
        os.mkdir(sticky)
        os.chmod(sticky, 0o1777)
        sock = os.path.join(sticky, "cache.sock")
        os.link(squatter.socket, sock)  # `out`'s socket under a free name in the sticky directory
    data, counts, errors = _read_as(u.inn, world, socket_path=sock)
    assert data == _origin_bytes(world) and (counts["daemon_reads"], counts["origin_reads"]) == (0, 1), counts
    assert len(errors) == 1 and "writable by others (sticky or not" in errors[0], errors
    assert squatter.stats()["counters"]["fills"] == {}  # the squatter was never asked for a shard
    out = u.inn.cli("stats", "--socket", sock)
    assert out.returncode == 1 and out.stdout == "" and _why(errors[0]) in out.stderr, out.stderr


@pytest.mark.parametrize("case", ["another user's socket in root's directory", "--daemon-user names another user"])
def test_client_refuses_a_daemon_of_the_wrong_uid(world, case):
    """The directory passes, but the kernel says the process answering is not the daemon's user:
    `out`'s socket linked into a root-owned directory (expected uid: the directory's owner, root), or
    a daemon run by root where the client was told `--daemon-user d`. Refused, before any `get`."""
    u = world.u
    if case.startswith("another"):
        squatter = world.daemon(u.out, "squatter")
        run = os.path.join(world.base, "run")
        os.mkdir(run)
        os.chmod(run, 0o755)
        sock, served_by, expected, extra = os.path.join(run, "cache.sock"), u.out, "uid 0 (root)", ()
        os.link(squatter.socket, sock)
    else:
        squatter = world.daemon(None, "root-daemon")
        os.chmod(squatter.dir, 0o755)
        os.chmod(squatter.socket, 0o666)  # so that `inn` may connect: the uid, not the mode, is the point
        sock, served_by, expected = squatter.socket, None, f"uid {u.d.uid} ({u.d.name})"
        extra = ("--daemon-user", u.d.name)
    endpoint = {"socket_path": sock, **({"daemon_user": u.d.name} if extra else {})}
    data, counts, errors = _read_as(u.inn, world, **endpoint)
    assert data == _origin_bytes(world) and counts["daemon_reads"] == 0, counts
    who = f"uid {served_by.uid} ({served_by.name})" if served_by else "uid 0 (root)"
    assert len(errors) == 1 and f"served by {who}" in errors[0] and expected in errors[0], errors
    assert squatter.stats()["counters"]["fills"] == {}
    out = u.inn.cli("stats", "--socket", sock, *extra)
    assert out.returncode == 1 and f"served by {who}" in out.stderr, out.stderr


@pytest.mark.parametrize("transport", ["unix, in the other user's 0755 directory", "tcp"])
def test_client_refuses_a_daemon_it_cannot_attribute(world, transport):
    """No daemon user configured, and the socket in a directory of `out`'s (0755, as /tmp/x or
    /dev/shm/x would be), or a TCP port `out` took: the client trusted whoever made the directory or
    answered (the audit's fake saw `6 get, 1 hello, 6 report` and could truncate what it handed out).
    Now nothing attributes that uid to the cache daemon: refused in one ERROR line before any request,
    origin read, and `cache stats` says the same. Naming the daemon's user lets the client in."""
    u = world.u
    tcp = f"127.0.0.1:{free_port()}" if transport == "tcp" else None
    fake = world.daemon(u.out, "fake", extra=("--tcp", tcp) if tcp else ())
    if not tcp:
        os.chmod(fake.dir, 0o755)
    endpoint = {"tcp": tcp} if tcp else {"socket_path": fake.socket}
    data, counts, errors = _read_as(u.inn, world, **endpoint)
    assert data == _origin_bytes(world) and (counts["daemon_reads"], counts["origin_reads"]) == (0, 1), counts
    assert len(errors) == 1 and "no daemon user is configured" in errors[0], errors
    assert f"owned by uid {u.out.uid}" in errors[0] if not tcp else f"served by uid {u.out.uid}" in errors[0]
    assert fake.stats()["counters"]["misses"] == {}  # never asked for a shard
    out = u.inn.cli("stats", *(("--tcp", tcp) if tcp else ("--socket", fake.socket)))
    assert out.returncode == 1 and out.stdout == "" and _why(errors[0]) in out.stderr, out.stderr
    data, counts, errors = _read_as(u.inn, world, daemon_user=u.out.name, **endpoint)
    assert data == _origin_bytes(world) and counts["daemon_reads"] == 1 and errors == [], (counts, errors)


@pytest.mark.parametrize("case", ["another user's socket at its path", "its socket directory read-only"])
def test_stop_unlinks_only_its_own_socket_and_finishes_cleanup(world, case):
    """Stopping, the daemon used to unlink whatever socket sat at its path (another user's, put there
    after its own was renamed away), and a PermissionError there ended the cleanup half-way, leaving
    the RAM tier (a /dev/shm segment) behind. Now it leaves what is not its own socket, and every
    cleanup step runs whatever an earlier one raised."""
    u = world.u
    d = world.daemon(u.d, start=False)
    sock_dir = os.path.join(world.base, "sock")
    os.mkdir(sock_dir)
    os.chown(sock_dir, u.d.uid, u.d.gid)
    os.chmod(sock_dir, 0o750)
    _set(d, "--socket", os.path.join(sock_dir, "c.sock"))
    d.start()
    d.request("get", shard=world.index.shards[0].name)  # something in the RAM tier
    if case.startswith("another"):
        os.rename(d.socket, d.socket + ".moved")
        other = socket.socket(socket.AF_UNIX)
        other.bind(d.socket)
        os.chown(d.socket, u.out.uid, u.out.gid)
    else:
        os.chmod(sock_dir, 0o550)  # the daemon's user may no longer unlink in it
    assert d.stop() == 0
    assert not os.path.exists(os.path.join(d.ram_dir, "data")), "cleanup stopped half-way: RAM tier left"
    log = d.log()
    assert "Traceback" not in log, log
    if case.startswith("another"):
        assert os.path.exists(d.socket) and os.lstat(d.socket).st_uid == u.out.uid
        assert "is no longer the socket this daemon published" in log
        other.close()
    else:
        assert "stopping: removing the socket failed (PermissionError" in log


@pytest.mark.parametrize("family", ["unix", "tcp 127.0.0.1", "tcp ::1"])
def test_kernel_tells_the_uid_at_the_other_end(users, family):
    """access.peer_uid, on which the client's daemon check and the daemon's `stop` check rest: the uid
    that created the other end, from SO_PEERCRED or the socket table, seen from both ends."""
    if family == "tcp ::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    with public_dir() as base:
        kind = {"unix": (socket.AF_UNIX, os.path.join(base, "s")), "tcp 127.0.0.1": (socket.AF_INET, ("127.0.0.1", 0)),
                "tcp ::1": (socket.AF_INET6, ("::1", 0))}[family]
        server = socket.socket(kind[0])
        server.bind(kind[1])
        server.listen()
        if family == "unix":
            os.chmod(kind[1], 0o777)
        with acting_as(users.inn):  # the client end belongs to `inn`
            client = socket.socket(kind[0])
            client.connect(kind[1] if family == "unix" else server.getsockname())
        accepted, _ = server.accept()
        try:
            assert (peer_uid(client), peer_uid(accepted)) == (0, users.inn.uid)
        finally:
            for s in (client, accepted, server):
                s.close()


# -- who may stop it ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_only_the_daemons_user_or_root_may_stop_it(world, transport):
    """Any group member (and, over TCP, anyone on the host) used to be able to stop the daemon for
    every trainer on the node. Now `stop` needs the daemon's uid or root, told by the kernel (the
    unix socket's SO_PEERCRED, /proc/net/tcp for loopback TCP); others get one line and a counter."""
    u = world.u
    tcp = f"127.0.0.1:{free_port()}" if transport == "tcp" else None
    d = world.daemon(u.d, extra=("--tcp", tcp) if tcp else ())
    endpoint = ("--tcp", tcp) if tcp else ("--socket", d.socket)
    refused = u.inn.cli("stop", *endpoint, "--daemon-user", u.d.name)  # as trainers are configured
    assert refused.returncode == 1 and "stop refused: only the daemon's user" in refused.stderr, refused.stderr
    assert f"uid {u.inn.uid}" in refused.stderr
    assert counter(d.stats(), "rejected", "stop_not_allowed") == 1 and d.proc.poll() is None  # still serving
    stopped = u.d.cli("stop", *endpoint)
    assert stopped.returncode == 0 and "stopping" in stopped.stdout, stopped.stderr
    assert d.proc.wait(timeout=15) == 0


# -- what a refused user is told ---------------------------------------------------------------------------
def test_refused_user_is_told_the_group_and_the_fix(world):
    """The socket in daemon-created 0750 parents (systemd's RuntimeDirectoryMode=0750): `out` cannot
    even stat it. The client's ERROR and `cache stats` / `cache stop` used to say `unknown` or only
    `[Errno 13] Permission denied`; now all three name the daemon's group and the fix."""
    u = world.u
    srv = os.path.join(world.base, "srv")
    os.mkdir(srv)
    os.chown(srv, u.d.uid, u.d.gid)
    d = world.daemon(u.d, start=False)
    _set(d, "--socket", os.path.join(srv, "run", "lf", "c.sock"))  # run/ and lf/ made by the daemon, 0750
    d.start()
    group = f"{u.group} (gid {u.gid})"
    _, counts, errors = _read_as(u.out, world, socket_path=d.socket)
    assert counts["daemon_reads"] == 0 and len(errors) == 1, errors
    for text in [errors[0]] + [u.out.cli(action, "--socket", d.socket).stderr for action in ("stats", "stop")]:
        assert "EACCES" in text and group in text and f"usermod -aG {u.group} {u.out.name}" in text, text
        assert f"the group of {srv}/run" in text, text
    assert d.proc.poll() is None  # `stop` never reached it
    assert u.inn.cli("stats", "--socket", d.socket, "--daemon-user", u.d.name).returncode == 0  # the member is let in


# -- a squatted RAM directory -----------------------------------------------------------------------------
def test_squatted_ram_directory_is_one_line_and_left_untouched(world):
    """`mkdir /dev/shm/loongforge-cache && chmod 777` by `out`, then `cache serve` by `d`: a raw
    PermissionError traceback and a `data/` of `d`'s inside `out`'s directory. Now one line naming the
    directory and its owner, nothing created in it (a /dev/shm-like 1777 directory here)."""
    u = world.u
    shm = os.path.join(world.base, "shm")
    os.mkdir(shm)
    os.chmod(shm, 0o1777)
    squat = os.path.join(shm, "loongforge-cache")
    os.mkdir(squat)
    os.chown(squat, u.out.uid, u.out.gid)
    os.chmod(squat, 0o777)
    d = world.daemon(u.d, start=False)
    _set(d, "--ram-dir", squat)
    out = _refused_at_start(d.args)
    line = _one_error_line(out.stderr)
    assert out.returncode == 1 and squat in line and f"uid {u.out.uid} ({u.out.name})" in line, line
    assert os.listdir(squat) == [] and not os.path.exists(d.socket)


def test_ssd_directory_the_daemons_user_cannot_create_is_one_line_and_leaves_no_ram_tier(world):
    """--ssd-dir under a directory the daemon's user may not write: a 24-line PermissionError traceback,
    and the RAM tier it had made first (`.lock`, `CACHE_FORMAT.json`, `data/`) left in /dev/shm. Now one
    line naming the directory and the fix, and the RAM tier removed."""
    u = world.u
    roots = os.path.join(world.base, "roots")  # root's, 0755: the daemon's user cannot create in it
    os.mkdir(roots)
    d = world.daemon(u.d, start=False)
    _set(d, "--ssd-dir", os.path.join(roots, "ssd"))
    out = _refused_at_start(d.args)
    line = _one_error_line(out.stderr)
    assert out.returncode == 1 and f"ssd tier {roots}/ssd" in line and "Permission denied" in line, line
    assert "install -d -o USER -m 0750" in line, line
    assert not os.path.exists(d.ram_dir) and not os.path.exists(d.socket), os.listdir(d.dir)


# -- what a group member may change under a reader ------------------------------------------------------------
def test_group_member_cannot_change_what_a_tcp_reader_maps(world):
    """Over TCP the client checked neither owner nor mode and hashed a file once per process: after a
    group member flipped a byte in a g+w tier file, the same reader's next map got the bad bytes. Now
    every map checks the mode, the owner (the daemon's uid from /proc/net/tcp) and the hash; the bad
    copy is reported, dropped and refilled, and the reader gets the origin's bytes."""
    u = world.u
    tcp = f"127.0.0.1:{free_port()}"
    d = world.daemon(u.d, extra=("--tcp", tcp))
    name = world.index.shards[0].name
    path = os.path.join(d.ram_dir, "data", name)
    client = CacheClient(world.root, world.index, tcp=tcp, fallback=False, daemon_user=u.d.name)
    try:
        with acting_as(u.inn):
            assert bytes(client.read_shard(name)) == _origin_bytes(world)
            client.release(name)
        wait_for(lambda: d.stats()["ssd_pending"] == 0, what="ssd write-through")
        os.chmod(path, 0o660)  # a mode slip of the daemon's user: the group may now write the file
        with acting_as(u.inn):
            with open(path, "r+b") as f:  # the group member, by its own uid
                f.seek(700)
                byte = f.read(1)
                f.seek(700)
                f.write(bytes([byte[0] ^ 0xFF]))
            assert bytes(client.read_shard(name)) == _origin_bytes(world)
    finally:
        client.close()
    st = d.stats()
    assert counter(st, "reports", "replaced") == 1 and counter(st, "corrupt", "ram") == 1, st["counters"]
    assert os.stat(path).st_mode & 0o777 == 0o640 and os.stat(path).st_uid == u.d.uid
