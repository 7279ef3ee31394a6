"""`loongforge train --elastic`: a supervisor process around torchrun that
survives rank loss and scales back up.

    loongforge train --elastic --min-ranks 1 --max-ranks 2 --data D --run-dir R --save-every 50 ...

Each attempt is a fresh, static torchrun launch (new port, so a new TCPStore
and new gloo connections) of `python -m loongforge.train ... --resume`:
* a fault (a rank killed, OOM, or stopped/hung: the watchdog's exit 75 and
  fault record) ends the launch; the supervisor relaunches without the ranks the
  attempt's fault records name, and no more than the capacity allows, from the
  last verified checkpoint (ckpt/fallback.py), refusing to go below --min-ranks;
* the global batch never changes: --grad-accum is recomputed so that
  micro batch x ranks x accum = global batch, the micro batch no larger than the
  full layout's (memory per rank stays bounded). The loader state is one global
  sample counter, so the data position is exact; noise is seeded per sample id;
  before a launch on another rank count, the checkpoint is converted to the new layout
  (elastic_reshard: ZeRO-1/2 partitions with their Adam moments; a failed conversion is a WARNING
  and the launch resumes the original tag), ZeRO-3 partitions are resharded by the trainer through
  the universal checkpoint;
* capacity: a rank slot "returns" when the capacity file (--capacity-file, one
  integer: ranks available on this machine; absent = --max-ranks) allows more
  than the current count. Once the launch has published a checkpoint (`latest`
  moves) the supervisor stops it (SIGTERM to the ranks: they finish the step in
  flight and write a checkpoint, stop.py) and relaunches with more ranks from it;
* the supervisor owns its launch: it holds the run dir's lock (runlock.py: a
  second launch on the run dir exits 2 naming it); torchrun dies with it
  (PR_SET_PDEATHSIG, whatever kills the supervisor) and the ranks with torchrun
  (owner.py); its SIGINT/SIGTERM go to the ranks themselves (torchrun's agent
  would print its own traceback and SIGKILL them after 30 s), which stop as
  stop.py says, record how in metrics.jsonl and exit 0, and the supervisor
  prints the one line and exits 130 / 85 / 143 (infra/train/README.md);
* a config error in a launch (a rank's exit 2 with its {"event": "stop",
  "config_error": true} record) ends the supervisor with exit 2: it is not a
  fault, and a relaunch would fail the same way. --min-ranks/--max-ranks are
  checked against --tp x --sp and the global batch before any launch.

Why not torchrun's own elastic agent: it restarts the whole local worker group
with the same --nproc-per-node (elastic only in the NUMBER OF NODES), so on one
node it cannot drop a rank; its in-place restart reuses the rendezvous and its
first restart can time out in gloo's connectFullMesh; and it knows
nothing of the global batch / grad accumulation or of which checkpoint verifies.
A fresh launch per attempt avoids all three. Multi-node: run one supervisor per
job with torchrun's --nnodes/--rdzv options passed through LOONGFORGE_TORCHRUN_ARGS.

Every decision is appended to metrics.jsonl as {"event": "elastic", ...}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from loongforge.shared.errors import ConfigError, TrainError, UsageError
from loongforge.train.observe.metrics import read_events
from loongforge.train.resilience import owner
from loongforge.train.resilience.elastic_reshard import convert_for_launch
from loongforge.train.resilience.exits import (EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_TERMINATED, SUPERVISOR_ENV)
from loongforge.train.resilience.runlock import LOCK_OWNER_ENV, RunLock

log = logging.getLogger(__name__)
ELASTIC_FLAGS = {"--elastic": 0, "--min-ranks": 1, "--max-ranks": 1, "--capacity-file": 1, "--max-restarts": 1,
                 "--grad-accum": 1, "--resume": 0}  # flag -> values it takes; the supervisor sets the last two
POLL_S = 0.5
KILL_AFTER_S = 30.0  # after a forwarded signal: the ranks' grace period plus this, then SIGKILL


def accum_for(global_batch: int, ranks: int, max_micro: int) -> int:
    """Smallest accumulation with micro x ranks x accum = global batch and micro <= max_micro."""
    for accum in range(1, global_batch + 1):
        if global_batch % (ranks * accum) == 0 and global_batch // (ranks * accum) <= max_micro:
            return accum
    raise ConfigError(f"--batch-size {global_batch} cannot be split over {ranks} ranks (micro batch x ranks x "
                      f"--grad-accum); use a global batch divisible by every rank count from --min-ranks to "
                      "--max-ranks")


def strip_flags(argv: list[str]) -> list[str]:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in ELASTIC_FLAGS:
            skip = ELASTIC_FLAGS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


class Supervisor:
    def __init__(self, args, train_argv: list[str]):
        self._check_usage(args)  # exit 2 before any launch
        self.capacity_file, self.max_restarts = args.capacity_file, args.max_restarts
        self.run_dir, self.batch, self.steps = args.run_dir, args.batch_size, args.steps
        self.grace_s = getattr(args, "term_grace_s", 60.0)
        self.argv = strip_flags(train_argv)
        self.resume_cmd = shlex.join(["loongforge", "train", *[a for a in train_argv if a != "--resume"], "--resume"])
        self.restarts = 0
        self._signal: int | None = None  # SIGINT/SIGTERM received: stop, do not relaunch
        self._proc: subprocess.Popen | None = None
        self.lock = RunLock(self.run_dir).acquire()  # one live run per run dir, for all launches
        if not args.resume:
            if _latest(self.run_dir):
                raise ConfigError(f"--run-dir {self.run_dir} already holds checkpoints: add --resume to continue "
                                  "that run, or give a new --run-dir")
            # A fresh run: clear the old metrics here, since every attempt (even the first) runs with --resume
            # and appends, so the supervisor's own records are never truncated away.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, "metrics.jsonl"))

    def _check_usage(self, args) -> None:
        """Every rank count this supervisor may launch must fit tp x sp and split the global batch."""
        if getattr(args, "batch_plan", None):
            raise UsageError("--elastic with --batch-plan: the plan's global batch depends on the rank count; "
                             "give --batch-size")
        self.min_ranks = args.min_ranks
        self.max_ranks = args.max_ranks or args.min_ranks
        if not 1 <= self.min_ranks <= self.max_ranks:
            raise UsageError(f"--min-ranks {self.min_ranks} / --max-ranks {self.max_ranks}: need 1 <= min <= max")
        self.layout = {"zero": getattr(args, "zero", 2), "tp": getattr(args, "tp", 1), "sp": getattr(args, "sp", 1),
                       "topk": getattr(args, "grad_compression", "none") == "topk"}
        self.group = self.layout["tp"] * self.layout["sp"]
        if self.min_ranks % self.group or self.max_ranks % self.group:
            raise UsageError(f"--min-ranks {self.min_ranks} / --max-ranks {self.max_ranks} with --tp "
                             f"{self.layout['tp']} --sp {self.layout['sp']}: every launch needs a multiple of tp x sp "
                             f"= {self.group} ranks; give --min-ranks and --max-ranks that are multiples of "
                             f"{self.group}")
        self.max_micro = max(1, args.batch_size // (self.max_ranks // self.group * args.grad_accum))
        try:  # every count in range must split the batch
            for ranks in range(self.min_ranks, self.max_ranks + 1, self.group):
                accum_for(args.batch_size, ranks // self.group, self.max_micro)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

    def _fit(self, ranks: int) -> int:
        """The largest launchable count <= ranks: a multiple of tp x sp."""
        return ranks - ranks % self.group

    def capacity(self) -> int:
        if not self.capacity_file or not os.path.exists(self.capacity_file):
            return self.max_ranks
        try:
            with open(self.capacity_file) as f:
                return max(0, min(self.max_ranks, int(f.read().strip() or 0)))
        except (OSError, ValueError):
            return self.max_ranks

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        ranks, reason = self._fit(min(self.capacity(), self.max_ranks)), "start"
        while True:
            if self._signal is not None:
                return self._report_stop(time.time())
            if ranks < self.min_ranks:
                self._event("give_up", ranks=ranks, reason=reason)
                raise TrainError(f"elastic: {ranks} ranks available after {reason}, below --min-ranks "
                                 f"{self.min_ranks}; resume later with --resume")
            t0 = time.time()
            rc, outcome, failed = self._attempt(ranks, reason)
            if outcome == "done":
                self._event("finished", ranks=ranks)
                return rc
            if outcome == "stopped":
                return self._report_stop(t0)
            if outcome == "scale_up":
                ranks, reason = self._fit(self.capacity()), f"capacity returned ({self.capacity()} ranks)"
                continue
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise TrainError(f"elastic: launch failed (exit {rc}) after {self.max_restarts} restarts; see the "
                                 "log above")
            # Ranks the watchdog named are gone; a failure it did not name (a rank killed outright, a decode
            # worker, an OOM) frees its slot on this machine: the capacity file says whether it is usable.
            ranks = self._fit(min(ranks - len(failed), self.capacity()))
            reason = f"fault: ranks {sorted(failed) or 'not named'} lost (launch exit {rc})"

    def _attempt(self, ranks: int, reason: str):
        accum = accum_for(self.batch, ranks // self.group, self.max_micro)
        converted = convert_for_launch(self.run_dir, world=ranks, **self.layout)
        if converted:
            self._event(**converted, ranks=ranks)
        self._event("launch", ranks=ranks, grad_accum=accum, reason=reason, latest=_latest(self.run_dir))
        log.info("elastic: launching %d ranks (grad accum %d, global batch %d, from the last checkpoint if any): %s",
                 ranks, accum, self.batch, reason)
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(ranks),
               "--master_port", str(_free_port()), *shlex.split(os.environ.get("LOONGFORGE_TORCHRUN_ARGS", "")),
               "-m", "loongforge.train", *self.argv, "--grad-accum", str(accum), "--resume"]
        t0, start_latest = time.time(), _latest(self.run_dir)
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), LOCK_OWNER_ENV: str(os.getpid())}
        # Its own session: a terminal's Ctrl-C reaches the supervisor only, which forwards it to the ranks.
        # PDEATHSIG: torchrun (and, through it, the ranks: owner.py) dies with the supervisor, however it dies.
        self._proc = proc = subprocess.Popen(cmd, start_new_session=True, env=env,
                                             preexec_fn=lambda: owner.die_with_parent(signal.SIGTERM))
        scaling = False
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                self._kill_if_overdue()
                latest = _latest(self.run_dir)
                if not scaling and self._signal is None and ranks < self._fit(self.capacity()) \
                        and latest not in (None, start_latest) and _tag_step(latest) < self.steps:
                    log.info("elastic: capacity for %d ranks and checkpoint %s published: stopping the launch to "
                             "scale up (the ranks write a checkpoint at the step in flight)", self.capacity(), latest)
                    scaling = True
                    self._forward(signal.SIGTERM)
        except BaseException:
            self._kill_launch()
            proc.wait()
            raise
        finally:
            self._proc = None
        rc, events = proc.returncode, _events_since(self.run_dir, t0)
        config = [e for e in events if e.get("event") == "stop" and e.get("config_error")]
        if config:
            raise UsageError(config[-1]["why"])
        if scaling:
            return rc, "scale_up", set()
        # Stopped on purpose: this supervisor's signal, or the ranks' own preemption (a checkpoint written) or
        # Ctrl-C. A bare SIGTERM record is torchrun stopping the survivors of a fault, and a torchrun killed by a
        # signal (rc < 0) took its ranks with it (they may have saved on the way out): both relaunch.
        if self._signal is not None or rc >= 0 and any(
                e.get("event") == "stop" and e.get("code") in (EXIT_PREEMPTED, EXIT_INTERRUPTED) for e in events):
            return rc, "stopped", set()
        if rc == 0:
            return rc, "done", set()
        # A fault record without a rank (torchrun's agent died, a start-up hang) drops no rank.
        failed = {e["rank"] for e in events if e.get("event") == "fault" and e.get("rank") is not None}
        self._event("fault", ranks=ranks, exit=rc, failed_ranks=sorted(failed))
        return rc, "fault", failed

    # -- signals: the supervisor's SIGINT/SIGTERM stop the run; the ranks get them, not torchrun ------------
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second one: stop waiting for the ranks' checkpoint
            log.warning("elastic: second signal: killing the launch")
            self._kill_launch()
            return
        self._signal, self._signal_at = signum, time.monotonic()
        log.warning("elastic: %s: stopping the launch (%s)", signal.Signals(signum).name,
                    "the ranks finish their step and write a checkpoint" if signum == signal.SIGTERM else
                    "no checkpoint")
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        ranks = owner.rank_pids(proc.pid)
        if ranks:
            owner.signal_all(ranks, signum)
        else:  # still starting: torchrun stops its workers itself
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    def _kill_if_overdue(self) -> None:
        if self._signal is not None and time.monotonic() - self._signal_at > self.grace_s + KILL_AFTER_S:
            log.warning("elastic: the launch did not stop within %.0f s of the signal: killing it",
                        self.grace_s + KILL_AFTER_S)
            self._kill_launch()

    def _kill_launch(self) -> None:
        proc = self._proc
        if proc is None:
            return
        owner.signal_all([*owner.descendants(proc.pid), proc.pid], signal.SIGKILL)

    def _report_stop(self, t0: float) -> int:
        """One line for a run stopped by a signal (the rank 0 stop record says whether it saved) and its code."""
        recs = [e for e in _events_since(self.run_dir, t0) if e.get("event") == "stop"]
        rec = recs[-1] if recs else {}
        if self._signal == signal.SIGINT:
            code = EXIT_INTERRUPTED
        else:
            code = EXIT_PREEMPTED if rec.get("code") == EXIT_PREEMPTED else EXIT_TERMINATED
        why = rec.get("why") or f"stopped by {signal.Signals(self._signal or signal.SIGTERM).name} before the " \
            f"ranks started; last checkpoint {_latest(self.run_dir) or 'none'}"
        self._event("stopped", exit=code, why=why)
        print(f"loongforge train: {why}; resume: {self.resume_cmd}", file=sys.stderr, flush=True)
        return code

    def _event(self, action: str, **kw) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"v": 1, "event": "elastic", "action": action, "t": time.time(), **kw}) + "\n")


def _latest(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _tag_step(tag: str) -> int:
    """stepNNNNNNNN, or a converted stepNNNNNNNN_wWzZtT (elastic_reshard)."""
    return int(tag[4:].split("_", 1)[0])


def _events_since(run_dir: str, t0: float) -> list[dict]:
    try:
        return [e for e in read_events(run_dir) if e.get("t", 0) >= t0]
    except OSError:
        return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(args, raw_argv: list[str]) -> int:
    train_argv = raw_argv[raw_argv.index("train") + 1:] if "train" in raw_argv else raw_argv
    return Supervisor(args, train_argv).run()
