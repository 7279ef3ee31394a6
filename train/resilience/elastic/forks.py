"""A warm process that forks ranks: the elastic supervisor's relaunches skip the interpreter and the
imports (torch, DeepSpeed, transformers: seconds per rank, on every rank of every restart).

    supervisor --Popen--> fork server (train/warm.py: imports everything a rank imports, then serves)
    supervisor --Popen--> agent.py (torchrun) --Popen--> `python -m loongforge.train ARGS` (a stand-in)
                                                          '-- asks the fork server over its socket --.
    fork server --fork--> the rank (runs ARGS as `python -m loongforge.train ARGS` would)  <---------'

The process torchrun starts stays what torchrun, the supervisor and anyone with `ps` see as the rank:
its argv, environment, stdio and exit are the rank's. It imports nothing heavy: it sends its argv,
environment, working directory and stdin/stdout/stderr (SCM_RIGHTS) to the server, which forks the
real rank with them, then it waits and leaves as the rank left (the same exit code, or the same
signal). Signals to the stand-in reach the rank: SIGTERM, SIGINT, SIGHUP, SIGUSR1/2 are forwarded;
a stopped stand-in (SIGSTOP) stops the rank, SIGCONT continues it (the server mirrors it within
STOP_POLL_S); a stand-in killed outright (SIGKILL) takes its rank with it (the server kills the rank
when the stand-in's connection closes). The server dies with the supervisor (PDEATHSIG) and every
rank with the server (PDEATHSIG SIGTERM: it stops as when its launcher dies, owner.py). The
supervisor's checkpoint conversions (convert.py) are forked the same way, called directly.

Why a fork is safe here: the server forks from a single thread, before any CUDA, thread pool or
process group exists in it (it only imported modules; no tensor op ran), so the child starts from
the state a fresh interpreter reaches after the same imports. Each fork checks that this still
holds (one thread in /proc/self/task, CUDA not initialised) and refuses otherwise; a stand-in that
is refused, or finds no server, execs the plain `python -m loongforge.train` in its own process
(the rank then imports as before). The child resets what a fresh process would not inherit: signal
handlers, the server's sockets, the environment, argv, `__main__` (multiprocessing's spawned
decode workers re-import the rank's main module, not the server's) and numpy's global RNG.

Only the supervisor's own launches use it (it sets WARM_ENV for them); torchrun, the deepspeed
launcher and a plain `loongforge train` start ranks as they always have. LOONGFORGE_WARM=0 turns
it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from typing import Callable

from loongforge.train.resilience import owner

log = logging.getLogger(__name__)
WARM_ENV = "LOONGFORGE_WARM_SOCKET"  # the server's socket, in the environment of the supervisor's launches
WARM_SWITCH = "LOONGFORGE_WARM"  # "0": the supervisor starts no server (ranks start plain)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOP_POLL_S = 0.2
_HEADER = struct.Struct("!I")
_MAX_MSG = 1 << 20


# -- the wire: length-prefixed JSON, with file descriptors on the first message --------------------------
def _send(sock: socket.socket, doc: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(doc).encode()
    msg = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at EOF) and the descriptors that came with it."""
    fds: list[int] = []
    buf = b""
    while len(buf) < _HEADER.size:
        if want_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, _HEADER.size - len(buf), want_fds)
        else:
            chunk = sock.recv(_HEADER.size - len(buf))
        if not chunk:
            return None, fds
        buf += chunk
    (n,) = _HEADER.unpack(buf)
    if n > _MAX_MSG:
        raise ValueError(f"message of {n} bytes")
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# -- the server -------------------------------------------------------------------------------------------
@dataclass
class _Child:
    pid: int
    conn: socket.socket
    watch: int  # the stand-in's pid (SO_PEERCRED): its stop/continue is mirrored; 0 for direct callers
    stopped: bool = False


def listen(path: str) -> socket.socket:
    """The server's socket, bound before its imports so that early clients queue instead of falling back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def fork_safe() -> str:
    """'' when this process may fork a rank, else why not."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 1
    if threads != 1:
        return f"{threads} threads in the fork server (OMP_NUM_THREADS > 1 starts BLAS threads at import)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the fork server"
    return ""


class ForkServer:
    """Serves fork requests on `sock` from one thread: `entries` maps a name to (the `python -m` module a
    fresh process would run, a function of argv returning an exit code)."""

    def __init__(self, sock: socket.socket, entries: dict[str, tuple[str, Callable[[list[str]], int]]]):
        self.sock, self.entries = sock, entries
        self.children: dict[int, _Child] = {}
        self.pid, self.parent = os.getpid(), os.getppid()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.refused_said = False

    def serve(self) -> None:
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        while os.getppid() == self.parent:  # PDEATHSIG ends it too; this covers a parent gone before it was set
            conns = {c.conn.fileno(): c for c in self.children.values()}
            try:
                ready, _, _ = select.select([self.sock, self._wake_r, *conns], [], [], STOP_POLL_S)
            except InterruptedError:
                ready = []
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            for fd in ready:
                if fd in conns and self._peer_gone(conns[fd].conn):
                    self._kill(conns[fd], signal.SIGKILL)  # the stand-in was killed outright
            if self.sock in ready:
                self._accept()
            self._mirror_stops()
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        fds: list[int] = []
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise PermissionError(f"uid {uid} is not this server's")
            conn.settimeout(10.0)  # one thread: a client that sends nothing holds the others at most this long
            req, fds = _recv(conn, want_fds=3)
            conn.settimeout(None)
            if not isinstance(req, dict) or len(fds) != 3 or req.get("entry") not in self.entries:
                raise ValueError(f"malformed request: {req!r} with {len(fds)} descriptors")
        except (OSError, ValueError) as exc:
            log.warning("fork server: refused a client: %s", exc)
            self._reply(conn, {"refused": str(exc)}, fds)
            return
        why = fork_safe() or (_room_for(req) if req.get("watch") else "")
        if why:
            if not self.refused_said:
                log.warning("fork server: not forking (%s): ranks start as fresh processes", why)
                self.refused_said = True
            self._reply(conn, {"refused": why}, fds)
            return
        child = os.fork()
        if child == 0:
            self._become(req, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        self.children[child] = _Child(child, conn, pid if req.get("watch") else 0)
        with contextlib.suppress(OSError):
            _send(conn, {"pid": child})

    def _reply(self, conn: socket.socket, doc: dict, fds: list[int]) -> None:
        with contextlib.suppress(OSError):
            _send(conn, doc)
        conn.close()
        for fd in fds:
            os.close(fd)

    @staticmethod
    def _peer_gone(conn: socket.socket) -> bool:
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _kill(self, c: _Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(c.pid, sig)

    def _mirror_stops(self) -> None:
        """A stopped stand-in stops its rank; continued, it continues it (SIGSTOP cannot be forwarded)."""
        for c in self.children.values():
            if not c.watch:
                continue
            stopped = owner.proc_state(c.watch) in ("T", "t")
            if stopped != c.stopped:
                c.stopped = stopped
                self._kill(c, signal.SIGSTOP if stopped else signal.SIGCONT)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self.children.pop(pid, None)
            if c is not None:
                with contextlib.suppress(OSError):
                    _send(c.conn, {"status": status})
                c.conn.close()

    def _become(self, req: dict, fds: list[int], conn: socket.socket) -> None:
        """In the forked child: turn into the process `python -m MODULE ARGV` would be, run it, exit."""
        code = 1
        try:
            module, entry = self.entries[req["entry"]]
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for fd in (self.sock.fileno(), self._wake_r, self._wake_w,
                       *(c.conn.fileno() for c in self.children.values()), conn.fileno()):
                with contextlib.suppress(OSError):
                    os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            owner.die_with_parent(signal.SIGTERM)  # as a rank dies with its launcher (owner.py)
            if os.getppid() != self.pid:  # the server died before that took effect
                os._exit(143)
            os.chdir(req["cwd"])
            os.environ.clear()  # every variable to the heap (putenv copies): the old area is free to rewrite
            os.environ.update(req["env"])
            _fresh_process_state(module, req["argv"])
            if req.get("watch"):  # a rank: /proc shows what its stand-in showed (the stand-in hides)
                set_identity([sys.executable, "-u", "-m", module.removesuffix(".__main__"), *req["argv"]],
                             dict(os.environ))
            code = int(entry(list(req["argv"])) or 0)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _fresh_process_state(module: str, argv: list[str]) -> None:
    """What differs between a fork of the server and `python -u -m MODULE ARGV` (MODULE: the module that
    runs as __main__, e.g. loongforge.train.__main__)."""
    spec = importlib.util.find_spec(module)
    main = types.ModuleType("__main__")
    main.__spec__, main.__file__ = spec, spec.origin
    sys.modules["__main__"] = main  # what multiprocessing's spawn re-imports in a decode worker
    sys.argv = [spec.origin, *argv]
    # `python -m` puts the working directory first, then PYTHONPATH (this environment's, not the server's)
    rest = sys.path[1:]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in rest]
    sys.path[:] = [os.getcwd(), *extra, *rest]
    for stream in (sys.stdout, sys.stderr):  # torchrun runs ranks with -u
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(write_through=True)
    tempfile.tempdir = None  # gettempdir() is cached: a fresh process reads this environment's TMPDIR
    np = sys.modules.get("numpy")
    if np is not None:  # forked children would share the server's global RNG state
        np.random.seed(int.from_bytes(os.urandom(4), "little"))
    with contextlib.suppress(OSError):  # `ps -o comm` tells a forked rank from its stand-in
        with open("/proc/self/comm", "w") as f:
            f.write(f"lf-{module.rsplit('.', 1)[-1]}"[:15])


# -- what /proc shows ---------------------------------------------------------------------------------------
ROOM_ENV = "LOONGFORGE_WARM_ROOM"  # the server's padding: room for a rank's argv and environment in /proc
ROOM_BYTES = 16384


def _mm_areas() -> tuple[int, int, int, int] | None:
    """(arg_start, arg_end, env_start, env_end): where the kernel reads /proc/self/cmdline and environ."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return tuple(int(x) for x in fields[45:49])  # fields 48-51 of proc(5), counted from field 3 here
    except (OSError, ValueError, IndexError):
        return None


def _write_area(start: int, end: int, words: list[bytes]) -> bool:
    blob = b"".join(w + b"\0" for w in words)
    if not start or len(blob) > end - start:
        return False
    ctypes.memmove(start, blob + b"\0" * (end - start - len(blob)), end - start)
    return True


def _room_for(req: dict) -> str:
    """'' when a rank's argv and environment fit where set_identity writes them, else why not."""
    areas = _mm_areas()
    if areas is None:
        return "no /proc/self/stat memory map (not Linux?)"
    a0, a1, e0, e1 = areas
    argv = sum(len(a.encode(errors="replace")) + 1 for a in req["argv"]) + len(sys.executable) + 32
    env = sum(len(f"{k}={v}".encode(errors="replace")) + 1 for k, v in req["env"].items())
    if argv > a1 - a0 or env > e1 - e0:
        return (f"a rank's argv ({argv} bytes) or environment ({env} bytes) exceeds the server's room "
                f"({a1 - a0} / {e1 - e0} bytes)")
    return ""


def set_identity(argv: list[str], env: dict | None = None) -> bool:
    """Show `argv` (and `env`) in /proc/self/cmdline (and environ), as setproctitle does: in place, within
    the memory the kernel reads them from, never past it. What finds a rank by its command line and
    environment (`ps`, the supervisor, the fault tools) then finds the forked rank, not the server it
    came from. The environment area may be rewritten only once libc's environ no longer points into it
    (os.environ.clear() then update() moved every variable to the heap). False if it does not fit."""
    areas = _mm_areas()
    if areas is None:
        return False
    a0, a1, e0, e1 = areas
    ok = _write_area(a0, a1, [a.encode(errors="replace") for a in argv])
    if env is not None:
        ok = _write_area(e0, e1, [f"{k}={v}".encode(errors="replace") for k, v in env.items()]) and ok
    return ok


# -- the clients ----------------------------------------------------------------------------------------
class Refused(Exception):
    """The server would not fork (its reason), or could not be reached."""


class Forked:
    """A child of the fork server, seen from the process that asked for it."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.status: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """The child's wait status (os.waitstatus_to_exitcode reads it), or None when the server went away
        first; raises TimeoutError after `timeout` seconds."""
        self.conn.settimeout(timeout)
        try:
            doc, _ = _recv(self.conn)
        except socket.timeout:
            raise TimeoutError(f"pid {self.pid} still running after {timeout} s") from None
        except OSError:
            doc = None
        self.conn.close()
        self.status = None if doc is None else int(doc["status"])
        return self.status

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)


def spawn(path: str, entry: str, argv: list[str], *, env: dict, cwd: str, fds: tuple[int, int, int] = (0, 1, 2),
          watch: bool = False, timeout: float = 300.0) -> Forked:
    """Ask the server at `path` to fork `entry` with `argv`; raises Refused. `timeout` bounds the wait for
    its answer (a server still importing answers once it is warm). `watch`: the server mirrors this
    process's stops onto the child and kills the child if this process dies (a stand-in)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(path)
        _send(conn, {"entry": entry, "argv": argv, "env": env, "cwd": cwd, "watch": watch}, fds)
        doc, _ = _recv(conn)
    except (OSError, ValueError) as exc:
        conn.close()
        raise Refused(f"fork server at {path}: {exc}") from None
    if doc is None or "pid" not in doc:
        conn.close()
        raise Refused((doc or {}).get("refused", "the fork server closed the connection"))
    conn.settimeout(None)
    return Forked(conn, int(doc["pid"]))


def stand_in(module: str, argv: list[str]) -> None:
    """The process torchrun started for a rank: have the server fork the rank, pass signals on, leave as it
    left. Without a server (or refused): exec `python -u -m MODULE ARGV` in this very process."""
    path = os.environ.pop(WARM_ENV, "")
    owner.die_with_parent(signal.SIGTERM)  # torchrun gone: the rank gets the SIGTERM a rank would get
    try:
        child = spawn(path, "rank", argv, env=dict(os.environ), cwd=os.getcwd(), watch=True)
    except Refused:  # the server said why in the node's log
        os.execv(sys.executable, [sys.executable, "-u", "-m", module, *argv])
    # From here /proc shows the forked rank as this process was (argv, environment): whoever looks for
    # rank N by its command line finds the rank itself, so a SIGKILL or SIGSTOP hits it directly, as
    # before; this process keeps `loongforge.train` in its argv (owner.rank_pids: the supervisor's
    # SIGTERM/SIGINT reach the rank through it) and its environment.
    set_identity(["loongforge.train", "stand-in", "for", f"pid {child.pid}"])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.kill(signum))
    status = child.wait()
    if status is None:  # the server died: its ranks got SIGTERM (PDEATHSIG); leave once this one is gone
        while owner.proc_state(child.pid) not in (None, "Z"):
            time.sleep(0.1)
        os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # died of a signal: so does this process, so that torchrun reports the same signal
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # a signal whose default is to continue (none of a rank's): leave anyway
    os._exit(code if code >= 0 else 128 - code)


class Server:
    """The supervisor's fork server: a socket in a private directory, bound here (so that stand-ins that
    come before the server is warm queue on it), and `python -m loongforge.train.warm` serving it, which
    dies with this process (PDEATHSIG)."""

    def __init__(self, *, env: dict, log_path: str):
        self.dir = tempfile.mkdtemp(prefix="lf-warm-")
        self.path = os.path.join(self.dir, "sock")
        sock = listen(self.path)
        room = "." * ROOM_BYTES  # argv and environment the forked ranks rewrite (set_identity)
        try:
            with open(log_path, "a") as log_file:  # its own lines (a refused fork) go to the node's log
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "loongforge.train.warm", "--fd", str(sock.fileno()), "--room", room],
                    env={**env, ROOM_ENV: room},
                    pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    start_new_session=True, preexec_fn=lambda: owner.die_with_parent(signal.SIGKILL))
        finally:
            sock.close()

    @classmethod
    def start(cls, *, env: dict, log_path: str) -> "Server | None":
        """A server unless LOONGFORGE_WARM=0 or this platform cannot pass descriptors (then None)."""
        if env.get(WARM_SWITCH, "1") == "0" or not hasattr(socket, "send_fds"):
            return None
        return cls(env=env, log_path=log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
