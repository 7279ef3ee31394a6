"""The faults of benchmarks/faults/run.py around a run rather than inside it: who owns the run dir and the
ranks, and how the run stops. Each is a trigger (as in faults/run.py) plus an `annotate(row, run, setup)`
that says what only this fault can: the second launch's refusal, the orphans left, the preemption's exit.

* second_launch_live_run_dir: a second `loongforge train --elastic --resume` on the live run dir must exit 2
  naming the holder (train/resilience/runlock.py); the first run finishes untouched.
* supervisor_sigkill: SIGKILL the elastic supervisor; every process of the run must be gone within seconds
  (train/resilience/owner.py), then `--resume` finishes the run.
* sigterm_preemption: SIGTERM the supervisor (a scheduler's preemption): the ranks finish the step, write a
  checkpoint and the supervisor exits 85; `--resume` continues from that step, none redone.
* kill_during_startup: SIGKILL the whole run while its ranks start (before the first step), then `--resume`.
* overwrite_refused: once the run has finished, the same command again without --resume, through the
  elastic supervisor and as a plain rank: each must exit 2 with one line naming the latest checkpoint,
  --resume and --overwrite, and leave every file of the finished run as it was (train/resilience/rundir.py).
A run stopped on purpose is resumed by `Run.relaunch()`: the row's exit is the resumed run's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from loongforge.train.resilience.elastic.supervisor import strip_flags

GONE_WITHIN_S = 30.0


RUN_MARK_ENV = "LOONGFORGE_FAULT_RUN"  # set by Run for the supervisor; every descendant inherits it


def run_pids(run) -> list[int]:
    """Every live process of this run (supervisor, torchrun, ranks, their decode workers): the ones whose
    environment carries the run's mark, inherited from the supervisor whoever their parent is now."""
    mark, out = f"{RUN_MARK_ENV}={run.run_dir}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except (OSError, IndexError):
            continue
        out.append(int(pid))
    return out


def _shm_files() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "lf"))}
    except OSError:
        return set()


def _wait_gone(run, timeout: float = GONE_WITHIN_S) -> tuple[float | None, list[int]]:
    """(seconds until no process of the run is left, or None) and what is left after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = run_pids(run)
        if not left:
            return time.monotonic() - t0, []
        time.sleep(0.1)
    return None, run_pids(run)


# -- a second launch on the live run dir --------------------------------------------------------------------
def f_second_launch(run):
    run.wait_steps(3)
    t = run.mark_fault()
    second = subprocess.run([*run.args, "--resume"], env=run.env, capture_output=True, text=True, timeout=300)
    run.note = {"second_exit": second.returncode, "second_wall_s": round(time.time() - t, 1),
                "second_said": next((ln for ln in second.stderr.splitlines() if "in use by a live run" in ln), "")}
    run.detected_t = time.time()
    return t


def annotate_second_launch(row: dict, run, setup) -> None:
    n = getattr(run, "note", {})
    row.update(n)
    row["detected_after_s"] = n.get("second_wall_s")
    refused = n.get("second_exit") == 2 and n.get("second_said")
    row["action"] = ("second launch refused (exit 2, names the holder); the live run went on" if refused else
                     f"second launch NOT refused (exit {n.get('second_exit')})")
    row["recovered"] = bool(row["recovered"] and refused and row["relaunches"] == 0)


# -- SIGKILL the supervisor: its ranks go with it -----------------------------------------------------------
def f_supervisor_sigkill(run):
    run.wait_steps(5)
    shm = _shm_files()
    t = run.mark_fault()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    gone_s, left = _wait_gone(run)
    run.note = {"descendants_gone_s": None if gone_s is None else round(gone_s, 1), "orphans": len(left),
                "shm_left": sorted(_shm_files() - shm)}
    if left:  # clean up for the resume, and say so in the row
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    run.detected_t = t + (gone_s or GONE_WITHIN_S)
    run.relaunch()
    return t


def annotate_supervisor_sigkill(row: dict, run, setup) -> None:
    n = getattr(run, "note", {})
    row.update(n)
    row["detected_after_s"] = n.get("descendants_gone_s")
    if n.get("orphans"):
        row["action"] = f"{n['orphans']} orphan process(es) left training; killed by the suite, then --resume"
        row["recovered"] = False
    else:
        row["action"] = (f"every rank and worker gone {n.get('descendants_gone_s')} s after the kill "
                         f"(PDEATHSIG/launcher watch), /dev/shm files left: {len(n.get('shm_left', []))}; "
                         "resumed with --resume")
        row["recovered"] = bool(row["recovered"] and not n.get("shm_left"))


# -- SIGTERM (preemption): checkpoint at the step, exit 85, exact resume ------------------------------------
def f_sigterm_preemption(run):
    run.wait_steps(5)
    t = run.mark_fault()
    os.kill(run.proc.pid, signal.SIGTERM)
    rc = run.proc.wait(timeout=300)
    latest = _latest(run.run_dir)
    done = len([r for r in run.rows() if "event" not in r])
    run.note = {"stop_exit": rc, "stop_s": round(time.time() - t, 1), "saved": latest,
                "steps_done_at_stop": done}
    run.detected_t = time.time()
    run.relaunch()
    return t


def annotate_sigterm_preemption(row: dict, run, setup) -> None:
    n = getattr(run, "note", {})
    row.update(n)
    row["detected_after_s"] = n.get("stop_s")
    at_step = n.get("saved") == f"step{n.get('steps_done_at_stop', -1):08d}"
    row["action"] = (f"SIGTERM: ranks finished the step, wrote {n.get('saved')} and exited {n.get('stop_exit')} "
                     f"in {n.get('stop_s')} s; resumed with --resume from it" if at_step else
                     f"SIGTERM: exit {n.get('stop_exit')}, `latest` {n.get('saved')} is not the last step "
                     f"({n.get('steps_done_at_stop')})")
    row["recovered"] = bool(row["recovered"] and n.get("stop_exit") == 85 and at_step)


# -- a kill while the ranks start ----------------------------------------------------------------------------
def f_kill_during_startup(run):
    deadline = time.monotonic() + 300
    while len([p for p in run_pids(run) if b"loongforge.train" in _cmd(p)]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # torchrun and both ranks are up, importing and meeting: rendezvous, process group, engine
    t = run.mark_fault()
    pids = run_pids(run)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.proc.wait()
    gone_s, left = _wait_gone(run)
    run.note = {"killed": len(pids), "steps_before_kill": run.steps_before_fault}
    run.detected_t = time.time()
    run.relaunch()
    return t


def annotate_kill_during_startup(row: dict, run, setup) -> None:
    n = getattr(run, "note", {})
    row.update(n)
    row["detected_after_s"] = None
    row["action"] = (f"{n.get('killed')} processes SIGKILLed at start-up (after {n.get('steps_before_kill')} "
                     "steps); --resume started cleanly (no stale lock, no hang)")


def _cmd(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _latest(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


# -- a fresh launch on a finished run's dir ------------------------------------------------------------------
def f_overwrite_refused(run):
    """Both refusals after the run ends: the supervisor (the run's own command) and a plain rank."""
    rc = run.proc.wait(timeout=900)
    before = _files(run.run_dir)
    plain = [sys.executable, "-m", "loongforge.train", *strip_flags(run.args[run.args.index("--data"):])]
    t = time.time()
    tries = {}
    for name, cmd in (("elastic", run.args), ("plain rank", plain)):
        t0 = time.time()
        out = subprocess.run(cmd, env=run.env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in out.stderr.splitlines() if "already holds a run" in ln]
        tries[name] = {"exit": out.returncode, "lines": len(lines), "said": lines[0] if lines else out.stderr[-300:],
                       "seconds": round(time.time() - t0, 1)}
    run.note = {"run_exit": rc, "tries": tries, "unchanged": _files(run.run_dir) == before}
    run.detected_t = time.time()
    return t


def annotate_overwrite_refused(row: dict, run, setup) -> None:
    n = getattr(run, "note", {})
    tries = n.get("tries", {})
    refused = bool(tries) and all(x["exit"] == 2 and x["lines"] == 1 and "--overwrite" in x["said"]
                                  for x in tries.values())
    row.update(n)
    row["detected_after_s"] = max((x["seconds"] for x in tries.values()), default=None)
    row["action"] = ("fresh launch on the finished run's dir refused on every path tried ("
                     + ", ".join(f"{k}: exit {v['exit']} in {v['seconds']} s" for k, v in tries.items())
                     + f"), one line naming the latest checkpoint; run dir unchanged: {n.get('unchanged')}"
                     if refused else f"NOT refused: {tries}")
    row["recovered"] = bool(row["recovered"] and refused and n.get("unchanged"))


def _files(run_dir: str) -> dict:
    out = {}
    for dirpath, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                out[os.path.relpath(path, run_dir)] = (st.st_size, st.st_mtime_ns)
    return out
