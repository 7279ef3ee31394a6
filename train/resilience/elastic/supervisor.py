"""`loongforge train --elastic`: one supervisor per node around torchrun, which survives the loss of
ranks and of whole nodes and scales back up.

    one node:  loongforge train --elastic --min-ranks 1 --max-ranks 2 --data D --run-dir R --save-every 50 ...
    N nodes:   the same command on every node, plus --nodes N --nproc-per-node K --node-addr ADDR
               (--node-id if two nodes share a hostname), with R on a filesystem every node shares

Each attempt is a fresh launch, on every node taking part, of `python -m loongforge.train ... --resume`
through agent.py (torchrun's launcher run in-process, so its tracebacks stay off the console), with
torchrun's c10d rendezvous hosted by the leader's launcher on a fresh port (a new store, new gloo
connections) and the node count fixed for the attempt:
* leader and followers (nodes.py): the supervisor that holds the run lock leads. It plans every
  attempt (which nodes, how many ranks each, the grad accumulation), converts the checkpoint for it
  and publishes the plan in the run dir; the others launch their part of it. A leader that dies hands
  the lead to the first follower to take the lock (leader.py, follower.py);
* a fault (a rank killed, OOM, stopped or hung: the watchdog's fault record; a node lost) ends the
  attempt on every node. The leader prints one line naming the rank or node and the cause and writes
  a fault record (blame.py), then relaunches without the ranks the watchdog named and the nodes that
  are gone, no more than the nodes offer, from the last verified checkpoint (ckpt/fallback.py), never
  below --min-ranks; faults spend the restart budget (budget.py: --max-restarts per --restart-window);
* the global batch never changes: --grad-accum is recomputed so that micro batch x ranks x accum =
  global batch, the micro batch no larger than the full layout's (memory per rank stays bounded). The
  loader state is one global sample counter, so the data position is exact; noise is seeded per sample
  id; before a launch on another rank count the checkpoint is converted to that world, the plan's
  (reshard.py: ZeRO-1/2 partitions with their Adam moments; a failed conversion is a WARNING and the
  launch resumes the original tag), and every rank checks that its launch has that world;
* scaling up: a node that joins or returns, or a node whose --capacity-file allows more ranks, is taken
  in once the attempt publishes its next checkpoint (`latest` moves): the leader stops the attempt
  (SIGTERM to its ranks: every rank finishes the step in flight and a checkpoint is written, stop.py)
  and relaunches bigger from it;
* a follower whose supervisor gets SIGTERM (its node preempted) or SIGINT leaves: every rank stops
  after the step (with a checkpoint on SIGTERM) and the run goes on on the other nodes, spending no
  budget. A follower whose supervisor is killed (no word of leaving) is lost, a fault, even when its
  ranks stopped after their step; no node's launcher waits in torchrun's exit barrier for a node that is
  gone (agent.py). The leader's SIGTERM or SIGINT stops the run on every node (each exits with the same code);
* the supervisor owns its launch: torchrun dies with it (PR_SET_PDEATHSIG, whatever kills it) and the
  ranks with torchrun (owner.py); its SIGINT/SIGTERM go to the ranks themselves, which stop as stop.py
  says and record how in metrics.jsonl; the leader prints the one line and exits 130 / 85 / 143
  (infra/train/README.md), and a rank 0 whose supervisor was killed prints it itself;
* a config error in a launch (a rank's exit 2 with its {"event": "stop", "config_error": true}
  record) ends the run with exit 2: it is not a fault, a relaunch would fail the same way;
* every wait for another node is bounded by --rdzv-timeout-s and announced in one line;
* a relaunch does not wait for imports: each supervisor starts a fork server as it starts (forks.py,
  train/warm.py), which imports what a rank imports once and forks every launch's ranks and the
  checkpoint conversions, and keeps the next launch's agent standing by, torch imported (agent.py
  --standby); this process itself never imports torch.

Why not torchrun's own elastic agent: it restarts the whole local worker group with the same
--nproc-per-node (elastic only in the NUMBER OF NODES), so on one node it cannot drop a rank; its
in-place restart reuses the rendezvous and its first restart can time out in gloo's
connectFullMesh; and it knows nothing of the global batch, of which checkpoint verifies or of
converting it. A fresh launch per attempt avoids all three.

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

from loongforge.shared.errors import ConfigError, UsageError
from loongforge.train.observe.metrics import read_events
from loongforge.train.resilience import owner
from loongforge.train.resilience.elastic import forks
from loongforge.train.resilience.elastic.budget import RestartBudget
from loongforge.train.resilience.elastic.nodes import Board
from loongforge.train.resilience.exits import (DEBUG_LOG_ENV, NODE_ENV, PLANNED_WORLD_ENV, RESUME_ENV,
                                               SUPERVISOR_ENV)
from loongforge.train.resilience.rundir import claim_fresh, latest_pointer, refuse_over_checkpoints
from loongforge.train.resilience.runlock import LOCK_OWNER_ENV, RunLock, describe, holder, joins_live_run
from loongforge.train.resilience.threads import launch_env

log = logging.getLogger(__name__)
ELASTIC_FLAGS = {"--elastic": 0, "--min-ranks": 1, "--max-ranks": 1, "--capacity-file": 1, "--max-restarts": 1,
                 "--restart-window": 1, "--nodes": 1, "--nproc-per-node": 1, "--node-id": 1, "--node-addr": 1,
                 "--rdzv-timeout-s": 1, "--overwrite": 0, "--grad-accum": 1, "--resume": 0}  # flag -> values
# torchrun options the supervisor sets per attempt; LOONGFORGE_TORCHRUN_ARGS may carry the others
OWN_TORCHRUN_ARGS = ("--nnodes", "--node_rank", "--node-rank", "--nproc_per_node", "--nproc-per-node", "--rdzv",
                     "--master_addr", "--master-addr", "--master_port", "--master-port", "--standalone",
                     "--max_restarts", "--max-restarts")
AGENT = "loongforge.train.resilience.elastic.agent"
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
    """What every node's supervisor does: checks, the run lock or the lead's, this node's launches and
    signals. Leading (leader.py) and following (follower.py) build on it."""

    def __init__(self, args, train_argv: list[str]):
        self._check_usage(args)  # exit 2 before any launch
        self.capacity_file = args.capacity_file
        self.run_dir, self.batch, self.steps = args.run_dir, args.batch_size, args.steps
        self.grace_s = getattr(args, "term_grace_s", 60.0)
        self.argv = strip_flags(train_argv)
        self.resume_cmd = shlex.join(["loongforge", "train", *[a for a in train_argv
                                                                if a not in ("--resume", "--overwrite")], "--resume"])
        self.budget = RestartBudget(args.max_restarts, args.restart_window)
        self.rdzv_timeout_s = args.rdzv_timeout_s
        self.node_id = args.node_id or socket.gethostname()
        self.node_addr = args.node_addr or ("127.0.0.1" if self.nodes == 1 else socket.getfqdn())
        self.nproc = args.nproc_per_node or (self.max_ranks if self.nodes == 1 else
                                             max(self.group, self.max_ranks // self.nodes))
        self.log_path = os.path.join(self.run_dir, "logs", f"node-{self.node_id}.log")
        self._signal: int | None = None  # SIGINT/SIGTERM received: stop (leader) or leave (follower)
        self._signal_at = 0.0
        self._proc: subprocess.Popen | None = None
        self.busy, self.ready_after, self.leaving = False, None, False
        # Read-only first: a refused fresh run leaves nothing behind (no lock file, no node registry). A node
        # joining a live multi-node run follows it: nothing fresh about that.
        if not joins_live_run(self.run_dir, self.nodes):
            refuse_over_checkpoints(self.run_dir, resume=args.resume, overwrite=args.overwrite)
        self.lock = RunLock(self.run_dir, extra={"nodes": self.nodes})
        if not self.lock.try_acquire():
            doc = holder(self.run_dir)
            if self.nodes == 1 or int(doc.get("nodes", 1)) == 1:  # not a multi-node leader: nobody to follow
                raise UsageError(f"--run-dir {self.run_dir} is in use by a live run ({describe(doc)}); stop that run "
                                 "first, or give another --run-dir")
        self.board = Board(self.run_dir, self.node_id)
        self.warm = None
        try:
            self.board.join(self.state())
            if self.lock.held:
                self._claim_fresh(args)
            # Warm from now on, while this node plans and waits: every launch's ranks are forked from it.
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
            self.warm = forks.Server.start(env=launch_env(dict(os.environ)), log_path=self.log_path)
            self._standby = None
            self._start_standby()
        except BaseException:
            self.close()
            raise

    def _check_usage(self, args) -> None:
        """Every rank count this supervisor may launch must fit tp x sp and split the global batch."""
        if getattr(args, "batch_plan", None):
            raise UsageError("--elastic with --batch-plan: the plan's global batch depends on the rank count; "
                             "give --batch-size")
        self.min_ranks = args.min_ranks
        self.max_ranks = args.max_ranks or args.min_ranks
        self.nodes = getattr(args, "nodes", 1)
        if not 1 <= self.min_ranks <= self.max_ranks:
            raise UsageError(f"--min-ranks {self.min_ranks} / --max-ranks {self.max_ranks}: need 1 <= min <= max")
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes}: need at least 1")
        self.layout = {"zero": getattr(args, "zero", 2), "tp": getattr(args, "tp", 1), "sp": getattr(args, "sp", 1),
                       "topk": getattr(args, "grad_compression", "none") == "topk"}
        self.group = self.layout["tp"] * self.layout["sp"]
        if self.min_ranks % self.group or self.max_ranks % self.group:
            raise UsageError(f"--min-ranks {self.min_ranks} / --max-ranks {self.max_ranks} with --tp "
                             f"{self.layout['tp']} --sp {self.layout['sp']}: every launch needs a multiple of tp x sp "
                             f"= {self.group} ranks; give --min-ranks and --max-ranks that are multiples of "
                             f"{self.group}")
        taken = [a for a in shlex.split(os.environ.get("LOONGFORGE_TORCHRUN_ARGS", ""))
                 if a.split("=", 1)[0].startswith(OWN_TORCHRUN_ARGS)]
        if taken:
            raise UsageError(f"LOONGFORGE_TORCHRUN_ARGS sets {' '.join(taken)}, which the supervisor sets for each "
                             "attempt: across nodes give --nodes, --nproc-per-node and --node-addr on every node")
        self.max_micro = max(1, args.batch_size // (self.max_ranks // self.group * args.grad_accum))
        try:  # every count in range must split the batch
            for ranks in range(self.min_ranks, self.max_ranks + 1, self.group):
                accum_for(args.batch_size, ranks // self.group, self.max_micro)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

    def _claim_fresh(self, args) -> None:
        """The lock holder, before the first launch: never train over checkpoints without --resume or
        --overwrite (rundir.py)."""
        if args.resume:
            return
        moved = claim_fresh(self.run_dir, resume=False, overwrite=args.overwrite)
        if moved:
            log.warning("--overwrite: the previous run in %s was moved aside to %s", self.run_dir, moved)
        # A fresh run: clear the old metrics here, since every attempt (even the first) runs with --resume
        # and appends, so the supervisor's own records are never truncated away.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, "metrics.jsonl"))

    # -- this node ---------------------------------------------------------------------------------
    def capacity(self) -> int:
        """Ranks this node offers now: --nproc-per-node, capped by the capacity file (one integer)."""
        if not self.capacity_file or not os.path.exists(self.capacity_file):
            return self.nproc
        try:
            with open(self.capacity_file) as f:
                return max(0, min(self.nproc, int(f.read().strip() or 0)))
        except (OSError, ValueError):
            return self.nproc

    def state(self) -> dict:
        return {"host": socket.gethostname(), "addr": self.node_addr, "pid": os.getpid(), "nproc": self.capacity(),
                "busy": self.busy, "ready_after": self.ready_after, "leaving": self.leaving}

    def close(self) -> None:
        standby, self._standby = getattr(self, "_standby", None), None
        if standby is not None:
            standby.kill()
            standby.wait()
        if self.warm is not None:
            self.warm.close()
        self.board.leave()
        self.lock.release()

    def warm_path(self) -> str | None:
        """The fork server's socket while it runs (forks.py), else None: ranks and conversions start plain."""
        return self.warm.path if self.warm is not None and self.warm.alive() else None

    # -- one launch of this node's part of an attempt -------------------------------------------------
    def launch(self, plan: dict, watch) -> tuple[int, dict]:
        """Run this node's ranks of `plan` through agent.py until they end; `watch(proc)` is called every
        POLL_S. Returns the launcher's exit code and its result (agent.py)."""
        mine = next(n["nproc"] for n in plan["nodes"] if n["id"] == self.node_id)
        leader = plan["leader"]
        result_path = os.path.join(self.run_dir, "logs", f"agent-{self.node_id}.json")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(result_path)
        peers = ",".join(n["id"] for n in plan["nodes"] if n["id"] != self.node_id)
        cmd = [sys.executable, "-m", AGENT, "--result", result_path, "--log", self.log_path, "--run-dir", self.run_dir,
               "--peers", peers, "--",
               "--nnodes", str(len(plan["nodes"])), "--nproc_per_node", str(mine), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", plan["rdzv"], "--rdzv-id", plan["rdzv_id"],
               "--rdzv-conf", f"join_timeout={int(self.rdzv_timeout_s)},is_host={int(leader['id'] == self.node_id)}",
               "--max-restarts", "0", *shlex.split(os.environ.get("LOONGFORGE_TORCHRUN_ARGS", "")),
               "-m", "loongforge.train", *self.argv, "--grad-accum", str(plan["grad_accum"]), "--resume"]
        env = launch_env({**os.environ, SUPERVISOR_ENV: str(os.getpid()), NODE_ENV: self.node_id,
                          LOCK_OWNER_ENV: f"{leader['pid']}@{leader['host']}", DEBUG_LOG_ENV: self.log_path,
                          RESUME_ENV: self.resume_cmd, PLANNED_WORLD_ENV: str(plan["world"])})
        env.pop(forks.WARM_ENV, None)  # another process's server (a test session's) is not this node's
        if (warm := self.warm_path()) is not None:
            env[forks.WARM_ENV] = warm  # train/__main__.py: the ranks are forked from the warm server
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._proc = proc = self._take_standby(cmd, env) or self._agent(cmd, env)
        ranks: dict[int, int] = {}  # pid -> start ticks of every rank seen: they may outlive a killed launcher
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                self._kill_if_overdue()
                ranks.update((pid, st[1]) for pid in owner.rank_pids(proc.pid) if (st := owner.proc_stat(pid)))
                if ranks:  # the ranks started: the next launch's agent imports now, beside their first steps,
                    self._start_standby()  # so that a fault early in this launch relaunches without waiting
                watch(proc)
        except BaseException:
            self._kill_launch()
            proc.wait()
            raise
        finally:
            self._proc = None
        self._wait_for_ranks(ranks)
        return proc.returncode, self._result(result_path, proc)

    def _agent(self, cmd: list[str], env: dict, *, stdin=None) -> subprocess.Popen:
        # Its own session: a terminal's Ctrl-C reaches the supervisor only, which forwards it to the ranks.
        # PDEATHSIG: the launcher (and, through it, the ranks: owner.py) dies with the supervisor, however it dies.
        return subprocess.Popen(cmd, start_new_session=True, env=env, stdin=stdin,
                                preexec_fn=lambda: owner.die_with_parent(signal.SIGTERM))

    def _start_standby(self) -> None:
        """The next launch's agent, started now and importing (torch: seconds) while nothing waits for it; the
        launch hands it its arguments (agent.py --standby). Nothing else differs from a fresh agent."""
        if self._standby is not None or self.warm_path() is None:  # LOONGFORGE_WARM=0: each process when needed
            return
        self._standby = self._agent([sys.executable, "-m", AGENT, "--standby"], launch_env(dict(os.environ)),
                                    stdin=subprocess.PIPE)

    def _take_standby(self, cmd: list[str], env: dict) -> subprocess.Popen | None:
        """The standby agent, given this launch (cmd's arguments and env), or None (none, or it died)."""
        proc, self._standby = self._standby, None
        if proc is None:
            return None
        job = {"env": env, "argv": cmd[cmd.index(AGENT) + 1:]}  # what follows `python -m AGENT` in a fresh one
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.close()
        except OSError:
            proc.kill()
            proc.wait()
            return None
        return proc

    def _wait_for_ranks(self, ranks: dict[int, int]) -> None:
        """A launcher that was killed leaves its ranks stopping on their own (PDEATHSIG: they may write a
        checkpoint): the attempt is over only when they are gone, or their records and `latest` could
        change under the next one. Bounded: the ranks' grace period plus KILL_AFTER_S, then SIGKILL."""
        def alive():
            return [pid for pid, start in ranks.items() if (st := owner.proc_stat(pid)) and st[1] == start
                    and owner.proc_state(pid) not in ("Z", None)]
        left, t0, said = alive(), time.monotonic(), False
        while left and time.monotonic() - t0 < self.grace_s + KILL_AFTER_S:
            if not said and time.monotonic() - t0 > 2:
                log.info("elastic: waiting up to %.0f s for the ranks of the ended launch (pids %s) to stop",
                         self.grace_s + KILL_AFTER_S, " ".join(map(str, left)))
                said = True
            time.sleep(0.2)
            left = alive()
        owner.signal_all(left, signal.SIGKILL)

    def _result(self, path: str, proc: subprocess.Popen) -> dict:
        try:
            with open(path) as f:
                return {**json.load(f), "node": self.node_id}
        except (OSError, ValueError):
            rc = proc.returncode
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with {rc} and no result"
            return {"rc": rc, "failures": [], "node": self.node_id, "t": time.time(),
                    "error": f"launcher: the node's torchrun (pid {proc.pid}) {how}"}

    def stop_launch_early(self, proc: subprocess.Popen, why: str) -> None:
        """A launch still starting whose peers will never come: stop its launcher now rather than let
        the rendezvous or gloo wait out their timeouts."""
        if trained_this_attempt(self.run_dir) or proc.poll() is not None:
            return  # the ranks train: a lost peer fails their next collective within seconds
        log.info("elastic: stopping this node's launch (%s)", why)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    # -- signals: SIGINT/SIGTERM stop the run (leader) or take this node out of it (follower) ---------
    def install_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second one: stop waiting for the ranks' checkpoint
            log.warning("elastic: second signal: killing the launch")
            self._kill_launch()
            return
        self._signal, self._signal_at = signum, time.monotonic()
        name, latest = signal.Signals(signum).name, latest_pointer(self.run_dir) or "none"
        if not self.lock.held:
            self.leaving = True
            with contextlib.suppress(OSError):
                self.board.publish(self.state())
        if self._proc is None:
            what = f"no launch running (last checkpoint {latest})"
        elif signum == signal.SIGINT:
            what = f"stopping the ranks, no checkpoint (last: {latest})"
        elif trained_this_attempt(self.run_dir):
            what = "the ranks finish their step and write a checkpoint"
        else:
            what = f"no rank has finished a step yet: stopping the launch, no checkpoint (last: {latest})"
        role = "" if self.lock.held else f"node {self.node_id} leaves the run: "
        log.warning("elastic: %s: %s%s", name, role, what)
        self.forward(signum)

    def forward(self, signum: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        ranks = owner.rank_pids(proc.pid)
        if ranks:
            owner.signal_all(ranks, signum)
        else:  # still starting: the launcher stops its workers itself (quietly: agent.py)
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

    # -- records -----------------------------------------------------------------------------------
    def event(self, action: str, **kw) -> None:
        self.record({"event": "elastic", "action": action, **kw})

    def record(self, rec: dict) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"v": 1, "t": time.time(), **rec}) + "\n")

    def say(self, line: str) -> None:
        """The supervisor's one line for a fault or a stop."""
        print(f"loongforge train: {line}", file=sys.stderr, flush=True)


def trained_this_attempt(run_dir: str) -> bool:
    """A step row in metrics.jsonl after the attempt's launch record (resume truncates the rows of the
    steps it redoes, never the records)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = f.readlines()
    except OSError:
        return False
    for line in reversed(lines):
        if '"event"' not in line:
            if line.strip().endswith("}"):
                return True
        elif '"action": "launch"' in line:
            return False
    return False


def tag_step(tag: str) -> int:
    """stepNNNNNNNN, or a converted stepNNNNNNNN_wWzZtT (reshard.py)."""
    return int(tag[4:].split("_", 1)[0])


def events_since(run_dir: str, t0: float) -> list[dict]:
    try:
        return [e for e in read_events(run_dir) if e.get("t", 0) >= t0]
    except OSError:
        return []


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
