"""Heartbeats and a hang watchdog: every rank reports its step to the launch's
TCPStore; a thread on every rank notices a peer that went silent (dead, or
stopped: SIGSTOP, a frozen node) within seconds and one whose step stopped
advancing (stuck collective, deadlocked loader) within --hang-timeout-s, and
ends this rank cleanly so the launch (and `--elastic`'s supervisor) can act.

Store: the one torch.distributed's env:// rendezvous already uses, at
MASTER_ADDR:MASTER_PORT (torchrun: its agent's store; the deepspeed launcher
and plain runs: the TCPStore served by rank 0). The watchdog opens its own
client connection with a short timeout, so a heartbeat never waits behind the
process group's own store traffic. No Redis needed; a launch always has one.

Test hook: LOONGFORGE_INJECT_HANG="S@R" blocks rank R at the start of step S
(phase "data", as a deadlocked loader would), its heartbeats still beating.

Keys: loongforge/hb/<restart>/<rank> = JSON {seq, step, phase, host, node, pid, done}.
Staleness is judged on this host's monotonic clock (when a peer's seq or step
last CHANGED), never by comparing wall clocks of two hosts.

On a fault: one ERROR line (under the elastic supervisor, which prints the one line
of the fault, the node's log file instead) and one metrics.jsonl record (written by
the first rank to claim it: {"event": "fault", kind, rank, host, node, why, ...}), a stopped peer on
this host is fenced (SIGKILL: a SIGSTOPped rank never handles the launcher's
SIGTERM, so the launch would wait for its kill timeout), the loader is closed,
the process group aborted where the backend can (NCCL), and the rank leaves with
os._exit(EXIT_PEER_FAULT): the main thread may be blocked in a collective
(DeepSpeed's CPU shm all-reduce spins without a timeout), so nothing waits for it.

A store that stops answering is blamed on whoever serves it: rank 0 under the
deepspeed launcher and plain runs, torchrun's agent under torchrun. The agent's
death is recorded as kind "launcher" with no rank, so `--elastic` does not drop
a healthy rank for it (normally the ranks stop sooner: they die with their
launcher, owner.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import torch

from loongforge.train.resilience.exits import EXIT_PEER_FAULT, bounded, debug_log, exit_now, node_id, supervised
from loongforge.train.resilience.nan_guard import parse_injection

log = logging.getLogger(__name__)
PREFIX = "loongforge/hb"
INJECT_HANG_ENV = "LOONGFORGE_INJECT_HANG"  # "STEP[@RANK]": that rank blocks forever at the start of STEP


def dead_after_s(heartbeat_s: float) -> float:
    return max(10 * heartbeat_s, 5.0)  # a loaded 2-core box can starve a process for seconds


class Watchdog:
    def __init__(self, *, rank: int, world: int, run_dir: str, heartbeat_s: float, hang_timeout_s: float,
                 closers=(), store=None):
        self.rank, self.world, self.run_dir = rank, world, run_dir
        self.heartbeat_s, self.hang_timeout_s = heartbeat_s, hang_timeout_s
        self.closers = list(closers)
        self.step, self.phase, self.done = 0, "start", False
        self.host, self.pid, self.node = socket.gethostname(), os.getpid(), node_id()
        self._store, self._seq = store, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._key = lambda r: f"{PREFIX}/{self._restart}/{r}"
        self._peers: dict[int, dict] = {}  # rank -> {"seq", "step", "seen", "moved", "doc"}
        self._store_failed_since: float | None = None
        self.muted = False  # a SIGTERM stop is under way: its grace timer bounds it (stop.py), not the watchdog
        self._launcher_pid = os.getppid()  # torchrun's agent serves the store when it is the launcher
        self._inject_hang = parse_injection(os.environ.get(INJECT_HANG_ENV), rank)

    @property
    def enabled(self) -> bool:
        return self.world > 1 and self.hang_timeout_s > 0

    def start(self) -> None:
        if not self.enabled:
            return
        if self._store is None:
            self._store = torch.distributed.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=max(2.0, self.heartbeat_s)), wait_for_workers=False)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="loongforge-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int, phase: str = "step") -> None:
        """Main thread: plain attribute writes, no I/O (the thread publishes them)."""
        self.step, self.phase = step, phase
        if step in self._inject_hang:  # test hook: a loader that deadlocks on this rank at this step
            self.phase = "data"
            log.warning("%s: rank %d hangs at step %d (test hook)", INJECT_HANG_ENV, self.rank, step)
            while True:
                time.sleep(3600)

    def mute(self) -> None:
        """Keep beating, stop judging: during a SIGTERM stop the launcher (and the store it serves) may
        be going away on purpose."""
        self.muted = True

    def stop(self, done: bool = True) -> None:
        if done and self.enabled and self._thread is not None:
            self.done = True
            with contextlib.suppress(Exception):
                self._beat()  # peers stop judging a rank that finished
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * self.heartbeat_s + 1)

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
                fault = self._check(time.monotonic())
                self._store_failed_since = None
            except Exception as exc:  # noqa: BLE001 - the store host (rank 0, or the agent) may be frozen
                fault = self._store_trouble(exc)
            if fault is not None and not self._stop.is_set() and not self.muted:
                self._fire(*fault)

    def _beat(self) -> None:
        self._seq += 1
        doc = {"seq": self._seq, "step": self.step, "phase": self.phase, "host": self.host, "node": self.node,
               "pid": self.pid, "done": self.done}
        self._store.set(self._key(self.rank), json.dumps(doc))

    def _check(self, now: float):
        keys = [self._key(r) for r in range(self.world) if r != self.rank]
        ready = [k for k in keys if self._store.check([k])]  # a peer that never beat yet is not judged
        docs = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in zip(ready, self._store.multi_get(ready))}
        for r, doc in docs.items():
            p = self._peers.setdefault(r, {"seq": -1, "step": -1, "seen": now, "moved": now})
            if doc["seq"] != p["seq"]:
                p["seq"], p["seen"] = doc["seq"], now
            if doc["step"] != p["step"]:
                p["step"], p["moved"] = doc["step"], now
            p["doc"] = doc
        if self.done:
            return None
        dead = dead_after_s(self.heartbeat_s)
        for r, p in sorted(self._peers.items()):
            if r != self.rank and not p["doc"]["done"] and now - p["seen"] > dead:  # self is judged by _hang
                return ("dead", r, p["doc"], now - p["seen"], f"no heartbeat for {now - p['seen']:.1f}s"
                        f"{_local_state(p['doc'], self.host)}")
        return self._hang(now)

    def _hang(self, now: float):
        """A step that stopped advancing. Every rank of a stuck collective stalls together; the one to
        name is a rank outside the collective (waiting for data) if any, else the lowest step."""
        me = {"step": self.step, "phase": self.phase, "host": self.host, "node": self.node, "pid": self.pid,
              "done": self.done}
        self._peers.setdefault(self.rank, {"seq": 0, "step": -1, "seen": now, "moved": now})
        mine = self._peers[self.rank]
        if mine["step"] != self.step:
            mine["step"], mine["moved"] = self.step, now
        mine["doc"] = me
        live = {r: p for r, p in self._peers.items() if not p["doc"]["done"]}
        if not any(now - p["moved"] > self.hang_timeout_s for p in live.values()):
            return None
        # Peers stall a heartbeat or two apart (each is seen on its own beat): choose among every rank
        # stalled for over half the timeout, so each survivor names the same culprit.
        stalled = {r: p for r, p in live.items() if now - p["moved"] > self.hang_timeout_s / 2}
        outside = [r for r, p in stalled.items() if p["doc"]["phase"] == "data"]
        r = min(outside) if outside else min(stalled, key=lambda k: (stalled[k]["step"], k))
        p = stalled[r]
        return ("hang", r, p["doc"], now - p["moved"], f"step {p['doc']['step']} not finished after "
                f"{now - p['moved']:.1f}s (phase {p['doc']['phase']}; --hang-timeout-s {self.hang_timeout_s:g})")

    def _store_trouble(self, exc: Exception):
        now = time.monotonic()
        self._store_failed_since = self._store_failed_since or now
        if now - self._store_failed_since <= dead_after_s(self.heartbeat_s):
            return None
        host, after = os.environ.get("MASTER_ADDR", "?"), now - self._store_failed_since
        where = f"the launch's TCPStore at {host}:{os.environ.get('MASTER_PORT')} has not answered for {after:.1f}s " \
            f"({type(exc).__name__})"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent serves the store, not rank 0: its death is the launcher's, and no rank is to be
            # dropped for it (the elastic supervisor drops the ranks a fault record names).
            state = {None: "is gone", "T": "is stopped", "Z": "exited"}.get(_proc_state(self._launcher_pid), "")
            local = f"; this host's torchrun agent (pid {self._launcher_pid}) {state}" if state else ""
            return ("launcher", None, {"host": host, "step": self.step}, after,
                    f"{where}: the torchrun agent serving it is dead or stopped{local}")
        return ("dead", 0, {"host": host, "step": self.step}, after,
                f"{where}; its host process, rank 0, is dead or stopped")

    def _fire(self, kind: str, rank: int, doc: dict, after_s: float, why: str) -> None:
        host = doc.get("host", "?")
        who = f"the launcher of {host}" if rank is None else f"rank {rank} on {host}"
        state = {"dead": "is dead or stopped", "launcher": "is dead or stopped"}.get(kind, "is hung")
        line = (f"watchdog: {who} {state}: {why} (at step {doc.get('step')}); rank {self.rank} ends with exit "
                f"{EXIT_PEER_FAULT} so the launch can restart{'' if rank is None else ' without it'}")
        if supervised():
            debug_log(self.run_dir, line)  # the supervisor prints the fault's one line
        else:
            log.error("%s", line)
        if self._first_to_report():  # one record per fault, from whichever rank's watchdog fired first
            record = {"v": 1, "event": "fault", "kind": kind, "rank": rank, "host": host, "node": doc.get("node"),
                      "why": why, "at_step": doc.get("step"), "detected_by": self.rank,
                      "detected_after_s": round(after_s, 2), "t": time.time()}
            with contextlib.suppress(OSError), open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if host == self.host and doc.get("pid") and _proc_state(doc["pid"]) == "T":
            with contextlib.suppress(OSError):
                os.kill(doc["pid"], signal.SIGKILL)  # fence: a stopped rank never handles the launcher's TERM
        bounded(self.closers + [_abort_process_group], 5.0, log)
        exit_now(EXIT_PEER_FAULT)


    def _first_to_report(self) -> bool:
        try:  # atomic on the store; a rank that hangs itself reports too, its peers may be stuck in gloo
            return self._store.add(f"loongforge/fault/{self._restart}", 1) == 1
        except Exception:  # noqa: BLE001 - the store is gone with its host: report from here
            return True


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _local_state(doc: dict, host: str) -> str:
    if doc.get("host") != host or not doc.get("pid"):
        return ""
    state = _proc_state(doc["pid"])
    return {None: f"; pid {doc['pid']} is gone", "T": f"; pid {doc['pid']} is stopped (SIGSTOP)",
            "Z": f"; pid {doc['pid']} exited"}.get(state, f"; pid {doc['pid']} state {state}")


def _abort_process_group() -> None:
    """NCCL communicators can be aborted from another thread (the blocked collective then fails); gloo has
    no abort: its blocked calls end with the process."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        torch.distributed.distributed_c10d._abort_process_group()
