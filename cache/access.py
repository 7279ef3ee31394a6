"""Who may use the daemon's socket and tier files, in one place: the modes the
daemon gives everything it creates (set with chmod after creation, so they do
not depend on the umask it was started under), and the checks every client
(the library and each `loongforge cache` command) makes before trusting a
socket or mapping a tier file. The daemon makes the same checks on itself.
"""

from __future__ import annotations

import grp
import os
import stat

from loongforge.cache.config import SOCKET_ENV, fallback_socket_dir
from loongforge.cache.protocol import Connection
from loongforge.shared.errors import CacheError

# Trainers connect and read tier files as members of the daemon's group; nobody else may (shard data
# is not public, and a world-readable /dev/shm tier is readable by every account on the node).
SOCKET_MODE = 0o660
FILE_MODE, DIR_MODE = 0o640, 0o750
PRIVATE_DIR_MODE = 0o700  # the per-user fallback socket directory under the shared /tmp


class UntrustedPathError(CacheError):
    """A socket directory or tier file another user could have planted or changed."""


def make_dirs(path: str, mode: int = DIR_MODE) -> None:
    """`mkdir -p` that gives every directory it creates exactly `mode`, whatever the umask
    (os.makedirs narrows the leaf by the umask and leaves created parents at 0777 & ~umask).
    Directories that already exist are left as they are: they are not ours."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue  # another thread made it (and sets its mode)
        os.chmod(d, mode)


def make_private_dir(path: str) -> None:
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        return  # checked by check_socket_dir, never re-moded: it may be someone else's
    os.chmod(path, PRIVATE_DIR_MODE)


def check_socket_dir(socket_path: str) -> None:
    """The one trust check of a unix socket's directory, made by the daemon before it binds and by
    every client before it connects. The per-user fallback directory under the shared /tmp must be
    a real directory (not a symlink) owned by this uid and closed to everyone else; any other
    directory must be a real directory that not everyone may write to (a world-writable one
    without the sticky bit lets anyone replace the socket). UntrustedPathError otherwise."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    private = parent == fallback_socket_dir()
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        if private:
            raise UntrustedPathError(f"socket directory {parent} does not exist: is the cache daemon running?") from None
        return  # connect() reports the missing socket
    is_dir = stat.S_ISDIR(st.st_mode)
    if private and (not is_dir or st.st_uid != os.geteuid() or st.st_mode & 0o077):
        raise UntrustedPathError(
            f"socket directory {parent} is not a private directory of uid {os.geteuid()} (owner uid {st.st_uid}, "
            f"mode {stat.filemode(st.st_mode)}): another user may have planted it. Remove it, or set "
            f"XDG_RUNTIME_DIR or {SOCKET_ENV} / --socket to a directory only you and the daemon can write")
    if not private and (not is_dir or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX)):
        raise UntrustedPathError(
            f"socket directory {parent} ({stat.filemode(st.st_mode)}, owner uid {st.st_uid}) is a symlink or "
            f"writable by every user without the sticky bit: anyone could replace the socket. Make it a real "
            f"directory writable only by the daemon's user (chmod 0750), or use another --socket")


def connect(socket_path: str | None, tcp: str | None, timeout: float) -> Connection:
    """A connection to the daemon, after check_socket_dir for a unix socket: what the client
    library and every CLI command use, so none of them can skip the check."""
    if not tcp:
        check_socket_dir(socket_path)
    return Connection(None if tcp else socket_path, tcp, timeout)


def file_problem(st: os.stat_result, owner_uid: int | None, size: int) -> str | None:
    """Why a tier file (stat of the opened file) must not be trusted, or None: not a regular file
    of the index's size, or (where the daemon's uid is known) owned by another uid or writable by
    anyone but its owner."""
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return (f"not a regular file of the index's size ({stat.filemode(st.st_mode)}, {st.st_size} bytes, "
                f"index {size}): replaced under us?")
    if owner_uid is not None and (st.st_uid != owner_uid or st.st_mode & 0o022):
        return (f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}, expected a file of the daemon "
                f"(uid {owner_uid}) writable only by it")
    return None


def open_no_follow(path: str) -> int:
    """A read-only fd of `path`, refusing a symlink in its last component (ELOOP)."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def group_of(path: str) -> str:
    """`NAME (gid N)` of the group owning `path`, for messages that tell an operator whom to add."""
    try:
        gid = os.stat(path).st_gid
    except OSError as exc:
        return f"(unknown: this user cannot stat {path}: {exc.strerror})"
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid} (no group of that id on this host)"
