"""Keep the optimizer state across an elastic rank-count change: before the supervisor relaunches
on another rank count, the last verified checkpoint is converted to the new layout.

    supervisor (elastic.py), between two launches, no process group up:
      needs_conversion(sidecar, target)?  ZeRO-1/2 partition the fp32 master weights and Adam
          moments by DP rank; loaded as they are on another rank count they would be dropped
          (checkpoint.check_layout "module"): convert. ZeRO-3 -> ZeRO-3 is converted by the trainer
          itself (ckpt/universal.py); ZeRO-0 is not partitioned (check_layout "replicated"): nothing to do.
      child process `python -m loongforge.train.resilience.elastic.convert RUN TAG LAYOUT` (convert.py):
          reshard(tag -> new tag `stepNNNNNNNN_wWzZtT`, `latest` NOT moved)
          verify the new tag against its manifest
          move `latest` to it (atomic rename, last)
      any failure (converter error, timeout, verification): WARNING, `latest` untouched, the new
          tag's debris removed; the launch resumes the original tag as before (weights and data
          order kept, the partitioned Adam state re-initialized).

Why the supervisor and not the trainer: the conversion runs while no rank is up, so no peer
waits in a timed collective while rank 0 converts (minutes on a large model), and a crash of the
converter cannot take a launch with it. The source tag stays on disk (retention removes it like
any older checkpoint once newer ones are published). The supervisor itself never imports torch or
the model (the child does): its start-up is not in the way of the first launch.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import fallback as ckpt_fallback, files as ckpt_files
from loongforge.train.resilience.elastic import forks

log = logging.getLogger(__name__)
TIMEOUT_S = 3600.0
CHILD = "loongforge.train.resilience.elastic.convert"  # the converting child (convert.py)


def needs_conversion(doc: dict, *, world: int, zero: int, tp: int, sp: int, topk: bool = False) -> bool:
    par = {"tp": 1, "sp": 1, **doc.get("parallel", {})}
    saved_zero = doc.get("zero_stage")
    if doc.get("world") == world and saved_zero == zero and (par["tp"], par["sp"]) == (tp, sp):
        return False  # same layout: loaded as it is
    hybrid = tp * sp > 1 or topk  # the trainer refuses these on another rank count (checkpoint.check_resume_layout)
    if (par["tp"], par["sp"]) == (tp, sp) and saved_zero == zero and zero in (0, 3) and not hybrid:
        return False  # ZeRO-0: replicated; ZeRO-3 -> ZeRO-3: the trainer's universal path
    return True


def convert_for_launch(run_dir: str, *, world: int, zero: int, tp: int = 1, sp: int = 1, topk: bool = False,
                       timeout_s: float = TIMEOUT_S, warm: str | None = None) -> dict | None:
    """Convert the checkpoint the next launch would resume to (world, zero, tp, sp). Returns a record
    for metrics.jsonl ({"action": "reshard", ...}), or None when there is nothing to convert. Never raises
    for a failed conversion: it is logged as a WARNING and the launch resumes the original tag. `warm`:
    the supervisor's fork server (forks.py), which forks the child with its imports done."""
    try:
        latest = ckpt_files.latest_tag(run_dir)
        if latest is None:
            return None
        # rank 0 alone: no process group is up in the supervisor
        tag = ckpt_fallback.pick_resume_tag(run_dir, latest)
        doc = ckpt_files.read_sidecar(run_dir, tag)
    except CheckpointError as exc:  # the trainer meets the same error and reports it
        log.warning("elastic: not converting the checkpoint before the relaunch: %s", exc)
        return None
    if not needs_conversion(doc, world=world, zero=zero, tp=tp, sp=sp, topk=topk):
        return None
    layout = f"world={world},zero={zero},tp={tp}" + (f",sp={sp}" if sp > 1 else "")
    t0 = time.monotonic()
    err = _run_child(run_dir, tag, layout, timeout_s, warm)
    rec = {"action": "reshard", "from_tag": tag, "from_world": doc["world"], "to": layout,
           "seconds": round(time.monotonic() - t0, 2)}
    if err:
        _remove_debris(ckpt_files.ckpt_root(run_dir))
        log.warning("elastic: converting checkpoint %s (%d ranks, ZeRO-%s) to %s failed, resuming it as it is "
                    "(ZeRO-1/2: weights and data order kept, the partitioned optimizer state re-initialized): %s",
                    tag, doc["world"], doc.get("zero_stage"), layout, err)
        return {**rec, "ok": False, "error": err[:500]}
    new = ckpt_files.latest_tag(run_dir)
    log.info("elastic: converted checkpoint %s to %s in %.1fs (%s): fp32 weights, Adam moments, step and LR "
             "schedule kept", tag, new, rec["seconds"], layout)
    return {**rec, "ok": True, "tag": new}


def _remove_debris(root: str) -> None:
    """A child killed at the timeout never ran its own cleanup: its work folder (reshard.py) goes here.
    Nothing else converts while the supervisor does (no launch is up)."""
    for name in os.listdir(root):
        if name.startswith(".reshard-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _run_child(run_dir: str, tag: str, layout: str, timeout_s: float, warm: str | None = None) -> str:
    """'' on success, else the reason (the child's last stderr line)."""
    argv = [run_dir, tag, layout]
    if warm is not None:
        try:
            return _run_forked(warm, argv, timeout_s)
        except forks.Refused:
            pass  # a fresh interpreter, as without a server
    try:
        proc = subprocess.run([sys.executable, "-m", CHILD, *argv], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f}s"
    return _last_line(proc.returncode, proc.stderr)


def _run_forked(warm: str, argv: list[str], timeout_s: float) -> str:
    """The child forked by the fork server, its stderr through a temporary file; raises forks.Refused."""
    with open(os.devnull, "r+b") as null, tempfile.TemporaryFile() as err:
        child = forks.spawn(warm, "convert", argv, env=dict(os.environ), cwd=os.getcwd(),
                            fds=(null.fileno(), null.fileno(), err.fileno()))
        try:
            status = child.wait(timeout_s)
        except TimeoutError:
            child.kill()
            child.wait(30.0)
            return f"timed out after {timeout_s:.0f}s"
        err.seek(0)
        text = err.read().decode(errors="replace")
    code = 1 if status is None else os.waitstatus_to_exitcode(status)
    return _last_line(code, text)


def _last_line(code: int, stderr: str) -> str:
    if code == 0:
        return ""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return (lines or [f"exit code {code}"])[-1][:500]
