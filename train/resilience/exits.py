"""How a rank ends: its exit codes, the exceptions a signal raises in the main thread, the resume
command it prints, and `exit_now`.

gloo processes sometimes abort at interpreter exit ("terminate called without an active
exception"), so after the process group is destroyed a rank flushes and leaves with
os._exit(code): a launch returns the run's real exit code, reliably. The watchdog leaves the
same way when a peer fails, without waiting for a main thread that may be blocked in a collective.
Which signal raises what, and when a checkpoint is written first: stop.py.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading

# The codes are documented in infra/train/README.md ("Exit codes").
EXIT_CONFIG = 2  # a usage or config error, found before any process group
EXIT_PEER_FAULT = 75  # EX_TEMPFAIL: "retry without the failed rank"; the elastic supervisor relaunches on it
EXIT_PREEMPTED = 85  # SIGTERM: the step in flight finished and a checkpoint was written; resume exactly from it
EXIT_INTERRUPTED = 130  # 128 + SIGINT (Ctrl-C): stopped where it was, no checkpoint written
EXIT_TERMINATED = 143  # 128 + SIGTERM without a checkpoint (--no-save-on-term, it would not fit, or it failed)
SUPERVISOR_ENV = "LOONGFORGE_SUPERVISOR"  # set by the elastic supervisor for its ranks: its pid


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
