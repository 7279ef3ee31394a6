"""A run dir that holds checkpoints is never trained over by accident.

A launch without --resume on a run dir whose `checkpoints/latest` names a checkpoint exits 2 with
one line naming that checkpoint and both ways on: --resume (continue it) or --overwrite (move it
aside and start afresh). Every launcher path checks before any process group:

* a rank (`python -m loongforge.train`: torchrun, the deepspeed launcher, `loongforge train`):
  `refuse_over_checkpoints` in train/__main__.py and launch.py, before torch is imported where it
  can be; only rank 0 prints the line, the other ranks exit 2 quietly;
* `--check-config` (the launch scripts run it in the launcher process): the same check;
* `loongforge train --elastic`: the supervisor that holds the run lock, before its first launch.

--overwrite moves the old run aside, under the run lock (so never under a live run): every entry of
the run dir except the lock itself and the elastic supervisors' node registry goes to the sibling
`RUN_DIR.replaced-YYYYmmddTHHMMSSZ` (inside the run dir when the sibling is on another filesystem).
Nothing is deleted.

Torch-free: train/__main__.py calls it before the trainer's imports (seconds) are paid.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time

from loongforge.shared.errors import UsageError
from loongforge.train.resilience.runlock import LOCK_FILE, RunLock, acquire_for_rank

log = logging.getLogger(__name__)

KEPT = (LOCK_FILE, "elastic")  # the live lock and the node registry (elastic/nodes: held by live supervisors)


def latest_pointer(run_dir: str) -> str | None:
    """The tag RUN_DIR/checkpoints/latest names (unchecked), or None."""
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def refusal(run_dir: str, latest: str) -> str:
    return (f"--run-dir {run_dir} already holds a run (latest checkpoint {latest}): add --resume to continue it, "
            "or --overwrite to move it aside (to a sibling RUN_DIR.replaced-TIME) and start afresh")


def refuse_over_checkpoints(run_dir: str, *, resume: bool, overwrite: bool) -> None:
    """UsageError (exit 2) when a fresh launch would train over checkpoints."""
    if resume or overwrite:
        return
    latest = latest_pointer(run_dir)
    if latest is not None:
        raise UsageError(refusal(run_dir, latest))


def move_aside(run_dir: str) -> str | None:
    """--overwrite: move the old run's entries (all but KEPT) to a new sibling directory; returns it, or
    None when there was nothing to move. The caller holds the run lock."""
    try:
        entries = sorted(set(os.listdir(run_dir)) - set(KEPT))
    except FileNotFoundError:
        return None
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = _new_dir(f"{os.path.abspath(run_dir).rstrip('/')}.replaced-{stamp}")
    try:
        os.rename(os.path.join(run_dir, entries[0]), os.path.join(dest, entries[0]))
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        os.rmdir(dest)  # the run dir is a mount point: keep the old run inside it
        dest = _new_dir(os.path.join(run_dir, f".replaced-{stamp}"))
        os.rename(os.path.join(run_dir, entries[0]), os.path.join(dest, entries[0]))
    for name in entries[1:]:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def _new_dir(base: str) -> str:
    path, n = base, 1
    while True:
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"


def claim_fresh(run_dir: str, *, resume: bool, overwrite: bool) -> str | None:
    """Under the run lock, before the first launch: refuse, or move the old run aside (returns where)."""
    if resume:
        return None
    if not overwrite:
        refuse_over_checkpoints(run_dir, resume=False, overwrite=False)
        return None
    return move_aside(run_dir)


def claim_for_rank(run_dir: str, rank: int, *, resume: bool, overwrite: bool) -> RunLock | None:
    """A rank's part (trainer, before its process group): rank 0 takes the run lock (runlock.py) and, as
    its holder, refuses a fresh run over checkpoints or moves them aside for --overwrite. Under the
    elastic supervisor every launch resumes and the supervisor holds the lock: nothing to do here."""
    lock = acquire_for_rank(run_dir, rank)
    if lock is None:
        return None
    try:
        moved = claim_fresh(run_dir, resume=resume, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise
    if moved:
        log.warning("--overwrite: the previous run in %s was moved aside to %s", run_dir, moved)
    return lock


def refuse_before_imports(argv: list[str]) -> None:
    """train/__main__.py, before the trainer's imports: the refusal in a fraction of a second (exit 2;
    the line from rank 0 only, every rank finds the same). Everything else about argv is left to the
    real parser."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--run-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    a, _ = p.parse_known_args(argv)
    if a.run_dir is None:
        return
    try:
        refuse_over_checkpoints(a.run_dir, resume=a.resume, overwrite=a.overwrite)
    except UsageError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"loongforge train: config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
