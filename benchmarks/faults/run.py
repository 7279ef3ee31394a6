"""Fault-injection suite: each fault against a real 2-rank gloo run under the
elastic supervisor, and a table of what happened.

    loongforge bench faults [--faults rank_sigkill,nan_loss] [--steps 12] [--out results]
    make faults

The faults around a run (a second launch on its run dir, the supervisor SIGKILLed,
SIGTERM preemption, a kill during start-up, a fresh launch over a finished run) are in
faults/owner.py; a run they stop on purpose is resumed with --resume, and its row reports
the resumed run. The loss of a whole node (two supervisors, one rank each) is in faults/nodes.py.

Every run is `loongforge train --elastic --min-ranks 1 --max-ranks 2` (tiny
recipe, global batch 8, checkpoint every 2 steps) on a synthetic shard root (faults/data.py), read
through a real cache daemon (`loongforge cache serve`) where the fault needs
one (with a real redis-server behind it for redis_sigkill). Clean runs of the same configuration,
one before the faults and one after, are the wall-time baseline.

Columns, all from the run's own records (metrics.jsonl step rows and
{"event": ...} records, the launch's exit):
* detected after: injection -> the first fault record (watchdog) or the
  supervisor's fault event, or -> the WARNING / skip that handled it (for a
  corrupt checkpoint: -> the relaunch's {"event": "ckpt_fallback"} record);
* steps redone: steps finished before the fault minus the step the relaunch
  resumed from;
* samples lost / duplicated: the sample ids of every step row against the
  global order for steps 0..N-1 (the trainer's loader's own epoch order: faults/data.py); both must be 0;
* wall cost: wall time of the faulted run minus the median of the clean runs' (one before the faults, one
  after: under a shared machine's changing load a single clean run made some costs negative).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from loongforge.benchmarks.faults import data as fd
from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.benchmarks.faults import env as fe
from loongforge.benchmarks.faults import nodes as fn
from loongforge.benchmarks.faults import owner as fo
from loongforge.benchmarks.harness.daemon import CacheDaemon

VENV_BIN = Path(sys.executable).parent
BATCH, SAVE_EVERY = 8, 2


class Run:
    """One supervised training run, with helpers a fault's trigger uses."""

    def __init__(self, work: Path, name: str, root: str, steps: int, extra=(), env=None, cache_socket=None):
        self.run_dir, self.steps = str(work / name), steps
        self.capacity = work / f"{name}.capacity"
        self.args = args = [str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1", "--max-ranks", "2",
                "--capacity-file", str(self.capacity), "--data", root, "--run-dir", self.run_dir,
                "--steps", str(steps), "--save-every", str(SAVE_EVERY), "--batch-size", str(BATCH), "--recipe",
                "tiny", "--seed", "1", "--no-ds-breakdown",
                "--heartbeat-s", "0.5", "--hang-timeout-s", "30", *extra,
                *(["--cache-socket", cache_socket] if cache_socket else [])]
        # A CPU benchmark: GPUs hidden, so the trainer and DeepSpeed both pick the CPU by themselves.
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", fo.RUN_MARK_ENV: self.run_dir, **(env or {})}
        self.log = open(work / f"{name}.log", "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.steps_before_fault = None

    def relaunch(self) -> None:
        """The same run again with --resume (after a fault that stops it on purpose); finish() waits for it."""
        self.proc = subprocess.Popen([*self.args, "--resume"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def rows(self) -> list[dict]:
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def wait_steps(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len([r for r in self.rows() if "step" in r]) < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.run_dir}: no {n} steps (exit {self.proc.poll()})")
            time.sleep(0.1)

    def mark_fault(self) -> float:
        self.steps_before_fault = max([r["step"] for r in self.rows() if "step" in r], default=-1) + 1
        return time.time()

    def rank_pid(self, rank: int) -> int:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"loongforge.train" in cmd and self.run_dir.encode() in cmd and f"RANK={rank}".encode() in env:
                return int(pid)
        raise RuntimeError(f"rank {rank} of {self.run_dir} not found")

    def finish(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            self.wall_s = time.time() - self.t0
            self.log.close()


# -- faults: each returns (injection time, what it did); the run handles the rest -------------------
def _kill_rank(run: Run, sig) -> float:
    run.wait_steps(5)
    run.capacity.write_text("1")  # the rank's slot is gone with it: finish on the survivor
    t = run.mark_fault()
    os.kill(run.rank_pid(1), sig)
    return t


def f_rank_sigkill(run):
    return _kill_rank(run, signal.SIGKILL)


def f_rank_sigstop(run):
    return _kill_rank(run, signal.SIGSTOP)


def f_writer_killed_mid_save(run):
    # --save-mbps 0.2 (see FAULTS) keeps each save on disk for seconds: SIGKILL rank 1 with a file half written.
    while not glob.glob(os.path.join(run.run_dir, "checkpoints", "step0000000[4-9]", "*.tmp")):
        if run.proc.poll() is not None:
            raise RuntimeError("run ended before a save was caught mid-file")
        time.sleep(0.02)
    run.capacity.write_text("1")
    t = run.mark_fault()
    os.kill(run.rank_pid(1), signal.SIGKILL)
    return t


def f_decode_worker_sigkill(run):
    run.wait_steps(2)  # early: the 2 workers fill 5 slots + 2 prefetched batches ahead, a late kill hits idle ones
    rank0 = run.rank_pid(0)
    kids = [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if _ppid(int(p)) == rank0
            and _is_decode_worker(int(p))]
    t = run.mark_fault()
    os.kill(max(kids), signal.SIGKILL)
    return t


def _is_decode_worker(pid: int) -> bool:
    """multiprocessing's spawned children of a rank, but not its resource tracker."""
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    return b"spawn_main" in cmd and b"resource_tracker" not in cmd


def f_cache_daemon_sigkill(run):
    # Early: a rank maps each shard once and reads it without the daemon afterwards, so the kill must come while
    # shards are still to be mapped (faults/data.py: a rank maps a new one at step 5-7, and
    # its prefetch reads at most 2 steps ahead).
    run.wait_steps(2)
    t = run.mark_fault()
    run.daemon.proc.kill()  # the loader's cache client falls back to the origin
    return t


def f_nan_loss(run):
    run.wait_steps(1)
    return run.t0  # injected through LOONGFORGE_INJECT_NAN at step 5 (rank 1); detection is the skip record


FAULTS = {  # name -> (trigger, extra train args, env, needs a cache daemon)
    "rank_sigkill": (f_rank_sigkill, (), {}, False),
    "rank_sigstop": (f_rank_sigstop, (), {}, False),
    "decode_worker_sigkill": (f_decode_worker_sigkill, ("--workers", "2"), {}, False),
    "cache_daemon_sigkill": (f_cache_daemon_sigkill, (), {}, True),
    "writer_killed_mid_save": (f_writer_killed_mid_save, ("--save-mbps", "0.2"), {}, False),
    "corrupt_checkpoint": (fe.f_corrupt_checkpoint, (), {}, False),
    "nan_loss": (f_nan_loss, (), {"LOONGFORGE_INJECT_NAN": "5@1"}, False),
}
FAULTS.update({  # faults_env.py: staged around the run (prepare before it starts, annotate the row after)
    "redis_sigkill": (fe.f_redis_sigkill, (), {}, True),
    "corrupt_shard_at_origin": (fd.f_corrupt_shard, (), {}, True),
    "checkpoint_disk_full": (fe.f_disk_full, (), {}, False),
    "cache_ssd_full": (fe.f_ssd_full, (), {}, True),
})
FAULTS.update({  # faults/owner.py: around the run (a second launch, the supervisor killed, preemption, start-up)
    # slow saves keep the first run alive for the seconds the second one takes to start and be refused
    "second_launch_live_run_dir": (fo.f_second_launch, ("--save-mbps", "0.2"), {}, False),
    "supervisor_sigkill": (fo.f_supervisor_sigkill, ("--workers", "2"), {}, False),
    "sigterm_preemption": (fo.f_sigterm_preemption, (), {}, False),
    "kill_during_startup": (fo.f_kill_during_startup, (), {}, False),
    "overwrite_refused": (fo.f_overwrite_refused, (), {}, False),
    "node_loss": (fn.f_node_loss, fn.node_args("a"), {}, False),  # faults/nodes.py: 2 supervisors x 1 rank
})
STAGED = {"corrupt_checkpoint": (None, fe.annotate_corrupt_checkpoint),
          "redis_sigkill": (fe.prepare_redis, fe.annotate_redis),
          "corrupt_shard_at_origin": (fd.prepare_corrupt_shard, fd.annotate_corrupt_shard),
          "checkpoint_disk_full": (fe.prepare_disk_full, fe.annotate_disk_full),
          "cache_ssd_full": (fe.prepare_ssd_full, fe.annotate_ssd_full),
          "second_launch_live_run_dir": (None, fo.annotate_second_launch),
          "supervisor_sigkill": (None, fo.annotate_supervisor_sigkill),
          "sigterm_preemption": (None, fo.annotate_sigterm_preemption),
          "kill_during_startup": (None, fo.annotate_kill_during_startup),
          "overwrite_refused": (None, fo.annotate_overwrite_refused),
          "node_loss": (None, fn.annotate_node_loss)}


def _ppid(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def summarize(name: str, run: Run, rc: int, t_inject: float, base_wall: float, expected) -> dict:
    rows = run.rows()
    steps = [r for r in rows if "event" not in r]
    events = [r for r in rows if "event" in r]
    seen = Counter(i for r in steps for ids in r["sample_ids"] for i in ids)
    want = Counter(i for ids in expected for i in ids)
    lost, dup = sum((want - seen).values()), sum((seen - want).values())
    faults = [e for e in events if e["event"] == "fault"]
    el_faults = [e for e in events if e["event"] == "elastic" and e["action"] == "fault"]
    launches = [e for e in events if e["event"] == "elastic" and e["action"] == "launch"]
    skips = [r for r in steps if r.get("nonfinite_skip")]
    detected_t, action = None, "none"
    if faults or el_faults:
        detected_t = min(e["t"] for e in faults + el_faults)
        who = faults[0] if faults else None
        action = (f"{_by(who)}: rank {who['rank']} {who['kind']} ({who['why']}); " if who else "launch ended; ") + \
            f"relaunched on {launches[-1]['ranks']} rank(s), grad accum {launches[-1]['grad_accum']}, " \
            f"from {launches[-1].get('latest')}"
    elif skips:  # checked before the update of the step that produced it: detection is in that step
        detected_t = t_inject
        action = (f"non-finite {skips[0]['nonfinite_skip']} at step {skips[0]['step']}: its optimizer step "
                  "skipped on every rank, counted (nonfinite_skips); weights untouched")
    log = Path(run.log.name).read_text(errors="replace")
    if "failed verification" in log:
        action += "; corrupt latest rejected (sha256), previous checkpoint loaded"
    if name == "cache_daemon_sigkill":
        noticed = [t for ln in log.splitlines() if "reading shards from origin" in ln
                   and (t := fe.log_time(ln)) is not None and t >= t_inject - 1]
        if noticed and detected_t is None:  # the client notices at its next request (a shard not yet open)
            detected_t = noticed[0]
        action = ("cache client fell back to the origin at its next read; no restart" if noticed else
                  "kill not noticed: no read asked the daemon after it (every shard already open)") \
            if len(launches) == 1 else action
    if name == "decode_worker_sigkill" and not (faults or el_faults):
        action = "decode worker replaced in place; no restart"
    redone = steps_redone(log)
    return {"fault": name, "detected_after_s": None if detected_t is None else round(detected_t - t_inject, 1),
            "action": action, "recovered": rc == 0 and [r["step"] for r in steps] == list(range(run.steps)),
            "steps_redone": redone, "samples_lost": lost, "samples_duplicated": dup,
            "wall_cost_s": round(run.wall_s - base_wall, 1), "exit": rc, "relaunches": len(launches) - 1,
            "t_inject": round(t_inject, 2), "wall_s": round(run.wall_s, 1)}


def _by(rec: dict) -> str:
    return "watchdog" if isinstance(rec.get("detected_by"), int) else "supervisor"


def steps_redone(log: str) -> int:
    """Per relaunch: the steps the previous attempt finished (rank 0's console lines "step N/T", N counted
    from 1; metrics.jsonl rows after the checkpoint are truncated on resume) - the steps done at the
    checkpoint it resumed (its "resumed from TAG at step K" line, which names the checkpoint really loaded,
    e.g. the fallback of a corrupt `latest`)."""
    done, prev_done, redone = 0, None, 0
    for line in log.splitlines():
        if "elastic: launching" in line:
            prev_done, done = done, 0
        elif line.startswith("step ") and line.split()[1].split("/")[0].isdigit():
            done = int(line.split()[1].split("/")[0])
        elif "resumed from step" in line and prev_done is not None and " at step " in line:
            redone += max(0, prev_done - int(line.split(" at step ")[1].split()[0]))
            prev_done = None  # one resume line per attempt (every rank logs it)
    return redone


def run_suite(names, *, steps: int, work: Path, baseline: bool = True) -> dict:
    root = str(work / "data")
    fd.make_root(root)
    expected = fd.expected_order(root, steps, BATCH)
    clean = [clean_run(work, "clean-0", root, steps)] if baseline else []
    rows = []
    for name in names:
        rows.append(run_fault(name, work, root, steps, expected))
        print(markdown_table({"rows": rows[-1:]}).splitlines()[-1], flush=True)
    if baseline:  # bracket the faults: the load of a shared machine moves during the suite
        clean.append(clean_run(work, "clean-1", root, steps))
    base_wall = sorted(clean)[len(clean) // 2] if len(clean) % 2 else sum(clean) / len(clean) if clean \
        else float("nan")
    for r in rows:
        if "wall_s" in r:
            r["wall_cost_s"] = round(r["wall_s"] - base_wall, 1)
    return {"suite": "faults", "format_version": 2, "host": socket.gethostname(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "steps": steps,
            "data_format": fd.format_version(root), "data": fd.describe(root), "ranks": 2, "global_batch": BATCH,
            "save_every": SAVE_EVERY, "clean_wall_s": round(base_wall, 1),
            "clean_runs_wall_s": [round(c, 1) for c in clean],
            "baseline": "median of a clean run before the faults and one after (mean of the two)",
            "load_avg": os.getloadavg(), "rows": rows}


def clean_run(work: Path, name: str, root: str, steps: int) -> float:
    run = Run(work, name, root, steps)
    if run.finish() != 0:
        raise RuntimeError(f"the clean run failed: {work / (name + '.log')}")
    return run.wall_s


def run_fault(name: str, work: Path, root: str, steps: int, expected) -> dict:
    trigger, extra, env, needs_cache = FAULTS[name]
    prepare, annotate = STAGED.get(name, (None, None))
    setup = prepare(work, root, name) if prepare else fe.Setup(root)
    if setup.skip_why:
        setup.close()
        return {"fault": name, "status": "not run", "why": setup.skip_why}
    daemon = run = None
    try:
        if needs_cache:
            daemon = CacheDaemon(setup.root, work / f"{name[:8]}-c", extra_args=setup.daemon_args).start()
        run = Run(work, name, setup.root, steps, extra, env, cache_socket=daemon.socket if daemon else None)
        run.daemon, run.setup = daemon, setup
        try:
            t = trigger(run)
        except Exception as exc:  # noqa: BLE001 - one broken fault must not lose the table
            t = time.time()
            print(f"{name}: trigger failed: {exc}", file=sys.stderr)
        rc = run.finish()
        row = summarize(name, run, rc, t, float("nan"), expected)
        if annotate:
            annotate(row, run, setup)
        return row
    finally:
        if daemon is not None:
            daemon.stop()
        setup.close()


COLUMNS = ("fault", "detected_after_s", "action", "recovered", "steps_redone", "samples_lost",
           "samples_duplicated", "wall_cost_s")


def markdown_table(doc: dict) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)
    lines = [head]
    for r in doc["rows"]:
        if r.get("status") == "not run":
            lines.append(f"| {r['fault']} | - | not run: {r['why']} | - | - | - | - | - |")
            continue
        cells = [("y" if r[c] else "n") if c == "recovered" else str(r[c]) for c in COLUMNS]
        if r.get("samples_skipped_by_policy"):
            cells[COLUMNS.index("samples_lost")] += f" ({r['samples_skipped_by_policy']} skipped by policy)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {', '.join(FAULTS)}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--workdir", type=Path, default=None, help="keep runs and logs here (default: a temp dir)")


def handle(args: argparse.Namespace) -> int:
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lf-faults-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc = run_suite(names, steps=args.steps, work=work)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(markdown_table(doc))
    print(f"\nresults: {path}")
    bad = [r["fault"] for r in doc["rows"] if r.get("status") != "not run" and
           not (r["recovered"] and r["samples_lost"] == 0 and r["samples_duplicated"] == 0)]
    return 1 if bad else 0
