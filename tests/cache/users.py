"""Real Unix users for the cache's access tests, as an outside audit sets them up: `d` runs the
daemon (primary group `group`), `inn` is a trainer in the daemon's group, `out` is another user of
the node in none of its groups. Created with useradd for the test session (root only; CI runs as
root) and removed after it."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

RUN_AS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_as.py")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]

    def cli(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """`python -m loongforge.cache ARGS` as this user."""
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, **kw)

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, RUN_AS, str(self.uid), str(self.gid), ",".join(map(str, self.groups)), *args]


@dataclass(frozen=True)
class Users:
    group: str
    gid: int
    d: User  # runs the daemon
    inn: User  # a trainer in the daemon's group
    out: User  # in none of the daemon's groups


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


def _user(name: str) -> User:
    pw = pwd.getpwnam(name)
    groups = sorted({pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)})
    return User(name, pw.pw_uid, pw.pw_gid, tuple(groups))


@contextmanager
def made_users():
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create the daemon's user, a group member and an outsider (CI has both)")
    tag = f"lft{os.getpid()}"
    # `shared`: the primary group of `inn` and `out`, as users of a node often share `users`
    group, shared, names = f"{tag}g", f"{tag}s", {"d": f"{tag}d", "inn": f"{tag}i", "out": f"{tag}o"}
    groups: list[str] = []
    made: list[str] = []
    try:
        for g in (group, shared):
            _run("groupadd", g)
            groups.append(g)
        for key, primary, extra in (("d", group, ()), ("inn", shared, ("-G", group)), ("out", shared, ())):
            _run("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-g", primary, *extra, names[key])
            made.append(names[key])
        yield Users(group, grp.getgrnam(group).gr_gid, **{k: _user(v) for k, v in names.items()})
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)
        for g in groups:
            subprocess.run(["groupdel", g], capture_output=True, timeout=60)


@contextmanager
def acting_as(user: User):
    """This process acts as `user` (effective ids and groups) inside the block: for the client
    library, which runs in the test process."""
    groups = os.getgroups()
    os.setgroups(list(user.groups))
    os.setegid(user.gid)
    os.seteuid(user.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


@contextmanager
def public_dir(mode: int = 0o755):
    """A directory under /tmp that other users may enter (pytest's tmp_path is root's, 0700)."""
    path = tempfile.mkdtemp(prefix="lf-u-")  # short: a socket path must fit in sun_path
    os.chmod(path, mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def public_copy(root: str, base: str) -> str:
    """A copy of a shard root that every user may read: the daemon's user reads origin from it."""
    dst = os.path.join(base, "origin")
    shutil.copytree(root, dst)
    for dirpath, dirs, files in os.walk(dst):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    return dst
