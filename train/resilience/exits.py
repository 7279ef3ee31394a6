"""How a rank ends: its exit codes, the exceptions a signal raises in the main thread, the resume
command it prints, where the tracebacks of a peer's failure go, and `exit_now`.

gloo processes sometimes abort at interpreter exit ("terminate called without an active
exception"), so after the process group is destroyed a rank flushes and leaves with
os._exit(code): a launch returns the run's real exit code, reliably. The watchdog leaves the
same way when a peer fails, without waiting for a main thread that may be blocked in a collective.
Which signal raises what, and when a checkpoint is written first: stop.py.

A failure in the step loop that is only the echo of a peer's (a collective that fails because a peer
process or node is gone: gloo's "Connection reset by peer", a DistNetworkError) is `peer_gone`
(launch.py asks only once the trainer is built: a start-up failure, a port in use, is shown as it
is): the rank leaves with EXIT_PEER_FAULT, its traceback goes to the node's debug log (`debug_log`),
and the console gets one WARNING line, or nothing under the elastic supervisor, which names the rank
that failed and why.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import threading
import time

# The codes are documented in infra/train/README.md ("Exit codes").
EXIT_CONFIG = 2  # a usage or config error, found before any process group
EXIT_PEER_FAULT = 75  # EX_TEMPFAIL: "retry without the failed rank"; the elastic supervisor relaunches on it
EXIT_PREEMPTED = 85  # SIGTERM: the step in flight finished and a checkpoint was written; resume exactly from it
EXIT_INTERRUPTED = 130  # 128 + SIGINT (Ctrl-C): stopped where it was, no checkpoint written
EXIT_TERMINATED = 143  # 128 + SIGTERM without a checkpoint (--no-save-on-term, it would not fit, or it failed)
SUPERVISOR_ENV = "LOONGFORGE_SUPERVISOR"  # set by the elastic supervisor for its ranks: its pid
NODE_ENV = "LOONGFORGE_NODE_ID"  # the supervisor's node id, inherited by its ranks (fault records name it)
DEBUG_LOG_ENV = "LOONGFORGE_DEBUG_LOG"  # the node's log file (the supervisor's); else RUN_DIR/logs/HOST.log
RESUME_ENV = "LOONGFORGE_RESUME_COMMAND"  # the supervisor's resume command, printed by rank 0 if it is gone
PLANNED_WORLD_ENV = "LOONGFORGE_PLANNED_WORLD"  # the world the supervisor planned (and converted the checkpoint to)
# What a collective says when a peer process or its node is gone (gloo, NCCL, the TCPStore).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker hanging",
             "Connection refused", "Socket Timeout", "Timed out waiting", "NCCL communicator was aborted")
PEER_GONE_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError")


class Terminated(BaseException):
    """SIGTERM (or the end of the grace period) without a checkpoint, raised in the main thread so that
    `finally` closes the loader (its decode workers and shared-memory slots) instead of the process
    vanishing mid-step. `why` says which case."""

    def __init__(self, why: str = "SIGTERM"):
        super().__init__(why)
        self.why = why


class Interrupted(BaseException):
    """SIGINT (Ctrl-C): the rank stops where it is; nothing is saved."""


class Preempted(BaseException):
    """SIGTERM, handled: every rank finished the same step and the checkpoint `tag` is published."""

    def __init__(self, tag: str, step: int):
        super().__init__(tag)
        self.tag, self.step = tag, step


def node_id() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


def peer_gone(exc: BaseException | None) -> bool:
    """A collective failed because another rank (or its node) is gone: any exception in the chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in PEER_GONE_TYPES or any(s in str(exc) for s in PEER_GONE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def debug_log_path(run_dir: str) -> str:
    return os.environ.get(DEBUG_LOG_ENV) or os.path.join(run_dir, "logs", f"{node_id()}.log")


def debug_log(run_dir: str, text: str) -> str:
    """Append `text` (a traceback, a detail the console does not need) to the node's log; returns its path."""
    path = debug_log_path(run_dir)
    head = f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {os.environ.get('RANK', '0')} pid {os.getpid()}: "
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(head + text.rstrip("\n") + "\n")
    except OSError:
        pass
    return path


def supervisor_alive() -> bool:
    """The elastic supervisor that started this rank is still there (it runs on this rank's node; a
    killed one may linger as a zombie until its parent reaps it)."""
    pid = os.environ.get(SUPERVISOR_ENV)
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, TypeError, ValueError, IndexError):
        return False


def supervised() -> bool:
    """Under `loongforge train --elastic`: the supervisor reports stops and faults, the ranks stay quiet."""
    return bool(os.environ.get(SUPERVISOR_ENV))


def resume_command(argv: list[str] | None = None, env=None) -> str:
    """The command that resumes this rank's launch: the same arguments with --resume, behind the
    launcher that started it (torchrun, deepspeed, or none)."""
    env = os.environ if env is None else env
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:  # the launcher's own per-rank flag is not the user's
        if skip or a == "--resume" or a.startswith(("--local_rank=", "--local-rank=")):
            skip = False
            continue
        if a in ("--local_rank", "--local-rank"):
            skip = True
            continue
        args.append(a)
    if args and args[0] == "train" and argv is None and os.path.basename(sys.argv[0]) == "loongforge":
        args = args[1:]  # `loongforge train ARGS`
    if "TORCHELASTIC_RUN_ID" in env:
        nodes = env.get("GROUP_WORLD_SIZE", "1")
        head = ["torchrun", "--nproc_per_node", env.get("LOCAL_WORLD_SIZE", "1"),
                *(["--nnodes", nodes] if nodes != "1" else []), "-m", "loongforge.train"]
    elif "LOCAL_SIZE" in env and "CROSS_RANK" in env:  # the deepspeed launcher's per-rank environment
        head = ["deepspeed", "--num_gpus", env["LOCAL_SIZE"], "--module", "loongforge.train"]
    else:
        head = ["loongforge", "train"]
    return shlex.join([*head, *args, "--resume"])


def bounded(closers, timeout_s: float, log: logging.Logger) -> None:
    """Run closers in a helper thread; whatever is still blocked after timeout_s is left behind (the
    main thread may be stuck in a collective, a closer behind it)."""
    def run():
        for c in closers:
            try:
                c()
            except Exception as exc:  # noqa: BLE001
                log.warning("teardown: %s", exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
