"""A follower: a node's supervisor while another one leads (holds the run lock, nodes.py).

    loop:
      the run's end in a plan of a leader this node followed -> exit with its code (one line)
      the run lock is free (the leader is gone) -> this node leads from here (leader.py)
      a plan of the current leader naming this node, not yet run -> launch this node's part of it;
            when it ends, publish the result and wait for the next plan
      otherwise wait, at most --rdzv-timeout-s (one line): a running launch takes a node in at its
            next checkpoint, so a checkpoint interval longer than that makes a joining node give up
A SIGTERM or SIGINT makes this node leave: its ranks stop (the others with them, after the step, with a
checkpoint on SIGTERM: stop.py), the leader goes on without it, and it exits 85 / 130 with one line.
"""

from __future__ import annotations

import logging
import signal
import time

from loongforge.shared.errors import TrainError
from loongforge.train.resilience.elastic.supervisor import POLL_S, Supervisor, events_since
from loongforge.train.resilience.exits import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_TERMINATED
from loongforge.train.resilience.rundir import latest_pointer
from loongforge.train.resilience.runlock import describe, holder

log = logging.getLogger(__name__)


def led_by(plan: dict | None, doc: dict) -> bool:
    """The plan comes from the supervisor that holds the run lock now (its lock file names it)."""
    leader = (plan or {}).get("leader") or {}
    return bool(doc) and leader.get("pid") == doc.get("pid") and leader.get("host") == doc.get("host")


class Follower:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.last: tuple | None = None  # (session, attempt) of the last launch this node ran
        self.unreported = None  # (plan, t0, result) of that launch while its leader has not judged it
        self.sessions: set[str] = set()  # leaders this node followed: their end is this node's end
        self.offered = sup.capacity()

    def run(self) -> int | None:
        """An exit code, or None when this node took the lead."""
        s = self.sup
        doc = holder(s.run_dir)
        log.info("elastic: node %s follows the leader (pid %s on %s)", s.node_id, doc.get("pid"), doc.get("host"))
        since, said = time.monotonic(), None
        while True:
            if s._signal is not None:
                return self._left(time.time())
            plan, doc = s.board.read_plan(), holder(s.run_dir)
            current = led_by(plan, doc)
            if current:
                self.sessions.add(plan["session"])
            if plan and plan.get("session") in self.sessions and plan["state"] != "launch":
                return self._ended(plan)
            if s.lock.try_acquire():  # the leader is gone: the kernel dropped its lock
                if not (plan and self.last == (plan.get("session"), plan.get("attempt"))):
                    self.unreported = None  # the old leader published a newer plan: it judged that attempt
                return None
            if current and plan["state"] == "launch" and (plan["session"], plan["attempt"]) != self.last \
                    and any(n["id"] == s.node_id for n in plan["nodes"]):
                code = self._attempt(plan)
                if code is not None:
                    return code
                since, said = time.monotonic(), None
                continue
            self._republish()
            waited = time.monotonic() - since
            if waited > s.rdzv_timeout_s:
                raise TrainError(f"elastic: node {s.node_id}: the leader ({describe(doc)}) took this node into no "
                                 f"launch within {s.rdzv_timeout_s:.0f} s (--rdzv-timeout-s; a running launch takes "
                                 "a node in at its next checkpoint): run the same command again to rejoin")
            key = (doc.get("pid"), (plan or {}).get("attempt"))
            if said != key and waited > 1.0:
                log.info("elastic: node %s waits up to %.0f s (--rdzv-timeout-s) for the leader (node %s, pid %s) to "
                         "take it into a launch (a running launch takes it in at its next checkpoint)", s.node_id,
                         s.rdzv_timeout_s - waited, ((plan or {}).get("leader") or {}).get("id", "?"), doc.get("pid"))
                said = key
            time.sleep(POLL_S)

    def _attempt(self, plan: dict) -> int | None:
        s = self.sup
        self.last = (plan["session"], plan["attempt"])
        mine = next(n["nproc"] for n in plan["nodes"] if n["id"] == s.node_id)
        log.info("elastic: node %s runs %d of the %d ranks of attempt %d (leader: node %s)", s.node_id, mine,
                 plan["world"], plan["attempt"], plan["leader"]["id"])
        t0 = time.time()
        s.busy = True
        s.board.publish(s.state())
        _, result = s.launch(plan, self._watch)
        s.busy, s.ready_after = False, plan["attempt"]
        s.board.publish(s.state())  # before the result: the leader plans with the nodes that are ready
        s.board.write_result(plan["session"], plan["attempt"], result)
        self.unreported = (plan, t0, result)
        return self._left(t0) if s._signal is not None else None

    def _watch(self, proc) -> None:
        s = self.sup
        self._republish()
        if s._signal is None and not s.lock.held and s.lock.try_acquire():  # the leader died under this launch
            log.warning("elastic: node %s: the leader is gone; this node leads after this launch ends", s.node_id)
            s.stop_launch_early(proc, "the leader and its rendezvous store are gone")

    def _republish(self) -> None:
        now = self.sup.capacity()
        if now != self.offered:
            self.offered = now
            self.sup.board.publish(self.sup.state())

    def _left(self, t0: float) -> int:
        """This node leaves on its own signal: one line, 85 (its ranks wrote a checkpoint) / 130 / 143."""
        s = self.sup
        latest = latest_pointer(s.run_dir) or "none"
        if s._signal == signal.SIGINT:
            code, what = EXIT_INTERRUPTED, f"left the run on SIGINT (no checkpoint; last {latest})"
        else:
            saved = [e for e in events_since(s.run_dir, t0) if e.get("event") == "stop" and e.get("code") == EXIT_PREEMPTED]
            code = EXIT_PREEMPTED if saved else EXIT_TERMINATED
            what = f"left the run on SIGTERM ({saved[-1]['why'] if saved else f'no checkpoint; last {latest}'})"
        s.say(f"node {s.node_id} {what}; the other nodes go on; to bring this node back: {s.resume_cmd}")
        return code

    def _ended(self, plan: dict) -> int:
        s = self.sup
        code = int(plan.get("code", 0))
        if plan["state"] == "finished":
            log.info("elastic: node %s: the run finished (leader: node %s)", s.node_id, plan["leader"]["id"])
        else:
            s.say(f"node {s.node_id}: the run {plan['state'].replace('_', ' ')} on the leader (node "
                  f"{plan['leader']['id']}): {plan.get('why')}")
        return code
