"""Who may use the daemon's socket and tier files, in one place: the modes the
daemon gives everything it creates (set with chmod after creation, so they do
not depend on the umask it was started under), and the checks every client
(the library and each `loongforge cache` command) makes before trusting a
socket or mapping a tier file. The daemon makes the same checks on itself.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import struct

from loongforge.cache.config import DAEMON_USER_ENV, SOCKET_ENV, fallback_socket_dir
from loongforge.cache.protocol import Connection
from loongforge.shared.errors import CacheError, ConfigError

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


def _who(uids) -> str:
    return " or ".join(f"uid {u} ({_user_name(u)})" for u in sorted(set(uids)))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user here"


def resolve_user(user: str | int | None) -> int | None:
    """The uid of a user name or number (`--daemon-user`, LOONGFORGE_CACHE_DAEMON_USER); None if unset."""
    if user is None or user == "":
        return None
    if isinstance(user, int) or str(user).isdigit():
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ConfigError(f"daemon user {user!r}: no such user on this host (give a name or a uid)") from None


def _ancestors(path: str) -> list[str]:
    out, parent = [], os.path.dirname(path)
    while parent != path:
        out.append(parent)
        path, parent = parent, os.path.dirname(parent)
    return out[::-1]


def unsafe_ancestor(path: str, trusted: set[int]) -> str | None:
    """What lets a user outside `trusted` swap `path` for something else, or None. Every directory
    on the way to it (as written and with symlinks resolved) must be owned by a trusted uid and not
    writable by others, unless sticky (in /tmp nobody may rename what another uid owns); a symlink on
    the way must be owned by a trusted uid. A missing one is not judged (whoever creates it checks)."""
    path = os.path.abspath(path)
    seen = set()
    for chain in (_ancestors(path), _ancestors(os.path.realpath(path))):
        for p in chain:
            if p in seen:
                continue
            seen.add(p)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                break  # nothing below exists on this chain
            mode = st.st_mode
            foreign = st.st_uid not in trusted
            open_to_others = stat.S_ISDIR(mode) and mode & 0o022 and not mode & stat.S_ISVTX
            if foreign or open_to_others:
                return (f"{p} ({stat.filemode(mode)}, owner uid {st.st_uid}) on the way to {path} is "
                        + (f"owned by another user than {_who(trusted)}" if foreign else
                           "writable by others without the sticky bit")
                        + ": whoever can change it can swap what lies below it")
    return None


def check_socket_dir(socket_path: str, daemon_uid: int | None = None) -> int | None:
    """The one trust check of a unix socket's directory, made by the daemon before it binds (with
    its own uid) and by every client before it connects. Returns the uid the daemon must have:
    `daemon_uid` if given (`--daemon-user`), else the directory's owner (a daemon can only bind in a
    directory it may write, and no one else may write this one), which must then be root or this
    user: any other owner may be anyone who made a directory, so without a daemon user configured
    there is nobody to attribute the daemon to and it is refused; None for a client when the
    directory does not exist (connect() then reports the missing socket). The per-user fallback directory
    under the shared /tmp must be a real directory of this uid, closed to everyone else; any other
    must be a real directory of root or the daemon's uid that no one else may write (sticky or not:
    a sticky /tmp lets anyone take a free name there). Every directory above it must be safe too
    (unsafe_ancestor). UntrustedPathError otherwise; PermissionError if this user cannot look."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    private = parent == fallback_socket_dir()
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        if private:
            missing = f"socket directory {parent} does not exist: is the cache daemon running?"
            raise UntrustedPathError(missing) from None
        if daemon_uid is not None:  # the daemon, before it creates the directory: not inside another user's
            _check_ancestors(socket_path, parent, daemon_uid)
        return daemon_uid  # a client: connect() reports the missing socket
    is_dir = stat.S_ISDIR(st.st_mode)
    if private:
        expected = os.geteuid() if daemon_uid is None else daemon_uid
        if not is_dir or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UntrustedPathError(
                f"socket directory {parent} is not a private directory of uid {os.geteuid()} (owner uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}): another user may have planted it. Remove it, or set "
                f"XDG_RUNTIME_DIR or {SOCKET_ENV} / --socket to a directory only you and the daemon can write")
    else:
        expected = st.st_uid if daemon_uid is None else daemon_uid
        why = ("is a symlink or not a directory" if not is_dir else
               f"is owned by another user than {_who({0, expected})}" if st.st_uid not in (0, expected) else
               "is writable by others (sticky or not: anyone may take a free name in it)" if st.st_mode & 0o022
               else None)
        if why:
            raise UntrustedPathError(
                f"socket directory {parent} ({stat.filemode(st.st_mode)}, owner uid {st.st_uid}) {why}: anyone could "
                f"replace the socket and pose as the daemon. Use a real directory owned by the daemon's user and "
                f"writable only by it (chmod 0750), or another --socket")
    _check_ancestors(socket_path, parent, expected)
    if daemon_uid is None and expected not in (0, os.geteuid()):
        raise UntrustedPathError(_unattributed(f"socket directory {parent}", expected))
    return expected


def _unattributed(what: str, uid: int | None) -> str:
    owner = "a uid that cannot be told" if uid is None else _who({uid})
    return (f"{what} is {'served by' if what.startswith('tcp:') else 'owned by'} {owner}, neither root nor "
            f"this user (uid {os.geteuid()}), and no daemon user is configured: nothing says that this user runs "
            f"the cache daemon (anyone may make a directory or take a port), so it is not trusted. Name the "
            f"daemon's user with --daemon-user / {DAEMON_USER_ENV} (e.g. loongforge), or use a socket in a "
            f"directory of root's (/run/loongforge)")


def _check_ancestors(socket_path: str, parent: str, uid: int) -> None:
    problem = unsafe_ancestor(parent, {0, uid})
    if problem:
        raise UntrustedPathError(f"socket {socket_path}: {problem}. Use a --socket under directories only root "
                                 f"and the daemon's user can change (e.g. /run/loongforge)")


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a connected socket, as the kernel knows it: the
    unix socket's SO_PEERCRED, or for loopback TCP the owner of the other end in /proc/net/tcp(6).
    None where it cannot be told (another network namespace, no /proc)."""
    if sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    table = "/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp"
    want = (_proc_addr(sock.family, sock.getpeername()), _proc_addr(sock.family, sock.getsockname()))
    try:
        with open(table) as f:
            next(f)
            for line in f:  # sl local remote st ... uid: the other end is local=their address, remote=ours
                cols = line.split()
                if (cols[1], cols[2]) == want and cols[3] == "01":  # 01 = ESTABLISHED
                    return int(cols[7])
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return None


def _proc_addr(family: int, addr: tuple) -> str:
    """An address as /proc/net/tcp(6) prints it: the IP's 32-bit words in host byte order, hex."""
    packed = socket.inet_pton(family, addr[0])
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{addr[1]:04X}"


def connect(socket_path: str | None, tcp: str | None, timeout: float,
            daemon_user: str | int | None = None) -> Connection:
    """A connection to the daemon that passed every check: what the client library and every CLI
    command use, so none of them can skip one. A unix socket's directory is checked first
    (check_socket_dir), then the uid at the other end (peer_uid) must be the daemon's: `daemon_user`
    if given (or LOONGFORGE_CACHE_DAEMON_USER), else the socket directory's owner. Over TCP the
    given daemon user is checked, else the uid answering must be root or this user's.
    `conn.peer_uid` is what the client checks tier files against."""
    expected = resolve_user(daemon_user if daemon_user is not None else os.environ.get(DAEMON_USER_ENV))
    if not tcp:
        expected = check_socket_dir(socket_path, expected)
    conn = Connection(None if tcp else socket_path, tcp, timeout)
    try:
        uid = conn.peer_uid = peer_uid(conn.sock)
        if tcp and expected is None and uid not in (0, os.geteuid()):
            raise UntrustedPathError(_unattributed(f"tcp:{tcp}", uid))
        if expected is not None and uid != expected:
            where = f"tcp:{tcp}" if tcp else socket_path
            served = "a process whose uid cannot be told" if uid is None else _who({uid})
            raise UntrustedPathError(
                f"{where} is served by {served}, not by the daemon's user, {_who({expected})}: another process "
                f"may pose as the cache daemon; refusing it. If the daemon runs as another user, say so with "
                f"--daemon-user / {DAEMON_USER_ENV}")
    except BaseException:
        conn.close()
        raise
    return conn


def file_problem(st: os.stat_result, owner_uid: int | None, size: int) -> str | None:
    """Why a tier file (stat of the opened file) must not be trusted, or None: not a regular file
    of the index's size, writable by anyone but its owner, or (where the daemon's uid is known)
    owned by another uid."""
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return (f"not a regular file of the index's size ({stat.filemode(st.st_mode)}, {st.st_size} bytes, "
                f"index {size}): replaced under us?")
    if st.st_mode & 0o022 or (owner_uid is not None and st.st_uid != owner_uid):
        expected = f"the daemon (uid {owner_uid})" if owner_uid is not None else "its owner"
        return (f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}, expected a file of {expected} "
                f"writable only by it")
    return None


def open_no_follow(path: str) -> int:
    """A read-only fd of `path`, refusing a symlink in its last component (ELOOP)."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def denied_message(socket_path: str) -> str:
    """The one message for a user the socket refuses (EACCES on the socket or on a directory above
    it), in the client's log and from `loongforge cache stats|stop`: the group that grants access,
    by name and gid, and the command that adds this user to it."""
    gid, where = _granting_gid(socket_path)
    user = _user_name(os.geteuid())
    if gid is None:
        group, fix = f"(unknown: {where})", "usermod -aG GROUP USER"
    else:
        try:
            name = grp.getgrgid(gid).gr_name
            group, fix = f"{name} (gid {gid}){where}", f"usermod -aG {name} {user}"
        except KeyError:
            group, fix = f"gid {gid} (no group of that id on this host){where}", "usermod -aG GROUP USER"
    return (f"cache daemon socket {socket_path}: permission denied (EACCES) for uid {os.geteuid()} ({user}). "
            f"Access is membership of the daemon's group, {group}: add this user to it ({fix}, then log in "
            f"again); the socket must stay group-writable (the daemon sets 0660; run it with UMask=0007). "
            f"See infra/cache/README.md, 'Socket access'")


def _granting_gid(socket_path: str) -> tuple[int | None, str]:
    """(gid, where it was read) of the group owning the socket or, when this user cannot reach the
    socket, of the first directory above it that it cannot enter (the daemon creates those with its
    group: systemd's RuntimeDirectory, `make_dirs`). (None, why) if neither can be told."""
    path = os.path.abspath(socket_path)
    try:
        return os.stat(path).st_gid, ""
    except PermissionError:
        pass
    except OSError as exc:
        return None, f"{exc.strerror} for {path}"
    for d in reversed(_ancestors(path)):  # the nearest directory first
        try:
            st = os.stat(d)
        except OSError:
            continue
        if not os.access(d, os.X_OK, effective_ids=True):
            return st.st_gid, f", the group of {d} ({stat.filemode(st.st_mode)}), which this user cannot enter"
    return None, f"this user cannot stat {path}"


def check_tier_root(root: str, tier: str) -> None:
    """Before a tier creates anything: its directory, if it exists, must be a real directory of this
    uid, and nothing above it may be changed by another user (unsafe_ancestor). A squatted
    /dev/shm/loongforge-cache (mkdir + chmod 777 by another user) is refused in one line, with
    nothing created inside it."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()):
        raise UntrustedPathError(
            f"{tier} tier directory {root} ({stat.filemode(st.st_mode)}) is owned by uid {st.st_uid} "
            f"({_user_name(st.st_uid)}), not by the daemon's uid {os.geteuid()}: another user may have planted it. "
            f"Remove it, or give the daemon its own --{tier}-dir")
    problem = unsafe_ancestor(root, {0, os.geteuid()})
    if problem:
        raise UntrustedPathError(f"{tier} tier directory {root}: {problem}; give the daemon its own --{tier}-dir")
