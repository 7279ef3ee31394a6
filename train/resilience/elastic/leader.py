"""The leader: the supervisor that holds the run lock plans every attempt, on every node.

    at the start, wait (at most --rdzv-timeout-s, one line) for --nodes nodes to join
    loop:
      plan: the live nodes that are ready (not in a launch, not leaving), this one first, each with the
            ranks it offers (at most its last launch's less the ranks the watchdog named), at most --max-ranks in
            all and a multiple of tp x sp; below --min-ranks: give up
      convert the checkpoint for the plan's world (reshard.py), then publish the plan (nodes.py)
      launch this node's part; its launcher hosts the attempt's c10d rendezvous store. Meanwhile: more
            ranks offered -> stop at the next checkpoint and relaunch bigger; a planned node lost
            before its ranks train -> stop now (the rendezvous and gloo would wait out their timeouts)
      wait (at most --rdzv-timeout-s, one line) for every other planned node's result
      outcome: finished | stopped (this supervisor's signal, or the ranks' own from outside) | a node
            left (its supervisor's SIGTERM/SIGINT: no fault) | scale up | a fault (blame.py: one line
            and a record; budget.py: relaunch or give up)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from loongforge.shared.errors import TrainError, UsageError
from loongforge.train.resilience.elastic.blame import name_fault
from loongforge.train.resilience.elastic.nodes import split_ranks
from loongforge.train.resilience.elastic.reshard import convert_for_launch
from loongforge.train.resilience.elastic.supervisor import (POLL_S, Supervisor, accum_for, events_since, free_port,
                                                            tag_step)
from loongforge.train.resilience.exits import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_TERMINATED
from loongforge.train.resilience.rundir import latest_pointer

log = logging.getLogger(__name__)


class Leader:
    def __init__(self, sup: Supervisor, *, takeover: bool = False, unreported=None):
        self.sup, self.takeover = sup, takeover
        self.unreported = unreported  # (plan, t0, this node's result) of the old leader's last attempt
        self.session = f"{sup.node_id}-{os.getpid()}-{int(time.time())}"
        self.attempt = 0
        self.caps: dict[str, int] = {}  # node -> at most this many ranks next time: its ranks less those the
        # last fault's watchdog named (a node's capacity file may say the same already: never both)
        self.reason = "took the lead: the previous leader is gone" if takeover else "start"
        self.scaling, self.start_latest, self.stopping_early, self.growth_said = False, None, False, None

    def run(self) -> int:
        s = self.sup
        s.board.drop_results(self.session)
        if self.takeover:
            log.warning("elastic: node %s leads the run now (the previous leader is gone)", s.node_id)
            if self.unreported:  # the old leader's last attempt ended with it: judge it as it would have
                plan, t0, mine = self.unreported
                code = self._outcome(plan, t0, {s.node_id: mine, **self._collect(plan)})
                if code is not None:
                    return code
        elif s.nodes > 1:
            self._wait_for_nodes()
        while True:
            if s._signal is not None:
                return self._stopped(time.time())
            plan = self._plan()
            code = self._attempt(plan)
            self.attempt += 1
            if code is not None:
                return code

    def _wait_for_nodes(self) -> None:
        s, t0, said = self.sup, time.monotonic(), False
        while s._signal is None:
            ready = [n for n, _ in self._offers()]
            if len(ready) >= s.nodes:
                return
            if time.monotonic() - t0 > s.rdzv_timeout_s:
                log.warning("elastic: %d of %d nodes joined within %.0f s (--rdzv-timeout-s): starting with %s; a "
                            "node that joins later is taken in at a checkpoint", len(ready), s.nodes,
                            s.rdzv_timeout_s, ", ".join(ready))
                return
            if not said:
                log.info("elastic: node %s leads; waiting up to %.0f s (--rdzv-timeout-s) for %d nodes to join (so "
                         "far: %s)", s.node_id, s.rdzv_timeout_s, s.nodes, ", ".join(ready))
                said = True
            time.sleep(POLL_S)

    # -- the plan ------------------------------------------------------------------------------------
    def _offers(self) -> list[tuple[str, int]]:
        """(node, ranks offered) of this node and every live follower ready for a launch."""
        s = self.sup
        out = [(s.node_id, s.capacity())]
        for n in s.board.live_nodes():
            if n["id"] != s.node_id and not n.get("busy") and not n.get("leaving"):
                out.append((n["id"], int(n.get("nproc", 0))))
        return out

    def _plan(self) -> dict:
        s = self.sup
        offers = [(node, min(n, self.caps.get(node, n))) for node, n in self._offers()]
        self.caps = {}
        split = split_ranks(offers, max_ranks=s.max_ranks, group=s.group)
        world = sum(n for _, n in split)
        if world < s.min_ranks or not split or split[0][0] != s.node_id:
            self._give_up(world, offers)
        return {"v": 1, "session": self.session, "attempt": self.attempt, "state": "launch",
                "nodes": [{"id": node, "nproc": n} for node, n in split], "world": world,
                "grad_accum": accum_for(s.batch, world // s.group, s.max_micro),
                "rdzv": f"{s.node_addr}:{free_port(s.node_addr)}", "rdzv_id": f"{self.session}-{self.attempt}",
                "leader": {"id": s.node_id, "pid": os.getpid(), "host": socket.gethostname()},
                "reason": self.reason}

    def _give_up(self, world: int, offers) -> None:
        s = self.sup
        s.event("give_up", ranks=world, reason=self.reason)
        self._end("gave_up", 1, f"{world} ranks available after {self.reason}")
        if world >= s.min_ranks:  # enough ranks, but not on this node, which hosts the rendezvous
            raise TrainError(f"elastic: node {s.node_id} leads but offers no rank (--capacity-file): the leader "
                             "hosts the rendezvous and must take part; resume later with --resume")
        raise TrainError(f"elastic: {world} ranks available after {self.reason}, below --min-ranks {s.min_ranks} "
                         f"(offered: {', '.join(f'{n} {k}' for n, k in offers)}); resume later with --resume")

    def _end(self, state: str, code: int, why: str) -> None:
        """The run's end, for the followers (nodes.py: they exit with `code`)."""
        s = self.sup
        s.board.write_plan({"v": 1, "session": self.session, "attempt": self.attempt, "state": state, "code": code,
                            "why": why, "leader": {"id": s.node_id, "pid": os.getpid(), "host": socket.gethostname()}})

    # -- one attempt -------------------------------------------------------------------------------
    def _attempt(self, plan: dict) -> int | None:
        s = self.sup
        converted = convert_for_launch(s.run_dir, world=plan["world"], warm=s.warm_path(), **s.layout)
        if converted:
            s.event(**converted, ranks=plan["world"])
        plan["latest"] = latest_pointer(s.run_dir)
        s.board.write_plan(plan)
        nodes = {n["id"]: n["nproc"] for n in plan["nodes"]}
        s.event("launch", ranks=plan["world"], grad_accum=plan["grad_accum"], reason=plan["reason"],
                latest=plan["latest"], nodes=nodes, attempt=self.attempt)
        where = "" if s.nodes == 1 else f" on {len(nodes)} node(s): {', '.join(f'{k} {v}' for k, v in nodes.items())}" \
            f" (rendezvous at {plan['rdzv']}: every node joins within {s.rdzv_timeout_s:.0f} s, --rdzv-timeout-s)"
        log.info("elastic: launching %d ranks%s (grad accum %d, global batch %d, from the last checkpoint if any): %s",
                 plan["world"], where, plan["grad_accum"], s.batch, plan["reason"])
        t0 = time.time()
        self.scaling, self.start_latest, self.stopping_early = False, plan["latest"], False
        self.growth_said = None
        s.busy = True
        s.board.publish(s.state())
        rc, mine = s.launch(plan, lambda proc: self._watch(plan, proc))
        s.busy, s.ready_after = False, self.attempt
        s.board.publish(s.state())
        results = {s.node_id: mine, **self._collect(plan)}
        return self._outcome(plan, t0, results)

    def _watch(self, plan: dict, proc) -> None:
        s = self.sup
        if s._signal is not None:
            return
        gone = [n["id"] for n in plan["nodes"] if n["id"] != s.node_id and not s.board.alive(n["id"])]
        if gone and not self.stopping_early:
            self.stopping_early = True
            s.stop_launch_early(proc, f"node {', '.join(gone)} is gone")
        more = self._more_ranks(plan)
        if more and more != self.growth_said:
            log.info("elastic: %s: taking it in at the next checkpoint of this launch", more)
            self.growth_said = more
        latest = latest_pointer(s.run_dir)
        if not self.scaling and more and latest not in (None, self.start_latest) and tag_step(latest) < s.steps:
            log.info("elastic: %s and checkpoint %s published: stopping the launch to scale up (the ranks write a "
                     "checkpoint at the step in flight)", more, latest)
            self.scaling = True
            s.forward(signal.SIGTERM)

    def _more_ranks(self, plan: dict) -> str | None:
        """What a relaunch now would add (capacity returned, a node joined), or None."""
        s = self.sup
        offers = self._offers()
        planned = {n["id"] for n in plan["nodes"]}
        offers += [(n["id"], int(n.get("nproc", 0))) for n in s.board.live_nodes()
                   if n["id"] in planned and n["id"] != s.node_id and n.get("busy")]  # in this launch
        world = sum(n for _, n in split_ranks(offers, max_ranks=s.max_ranks, group=s.group))
        if world <= plan["world"]:
            return None
        joined = sorted({node for node, n in offers if n} - planned)
        return f"capacity for {world} ranks" + (f" (node {', '.join(joined)} joined)" if joined else "")

    def _collect(self, plan: dict) -> dict:
        """Every other planned node's result of this attempt: until it comes or the node is gone, at most
        --rdzv-timeout-s."""
        s, t0, said = self.sup, time.monotonic(), False
        others = [n["id"] for n in plan["nodes"] if n["id"] != s.node_id]
        got: dict = {n: None for n in others}
        while True:
            for n in others:
                got[n] = got[n] or s.board.read_result(plan["session"], plan["attempt"], n)
            pending = [n for n in others if got[n] is None and s.board.alive(n)]
            if not pending:
                return got
            waited = time.monotonic() - t0
            if waited > s.rdzv_timeout_s:
                log.warning("elastic: node %s did not end its part of attempt %d within %.0f s (--rdzv-timeout-s): "
                            "left out of the next launch", ", ".join(pending), plan["attempt"], s.rdzv_timeout_s)
                return got
            if not said and waited > 2:
                log.info("elastic: waiting up to %.0f s (--rdzv-timeout-s) for node %s to end its part of attempt %d",
                         s.rdzv_timeout_s, ", ".join(pending), plan["attempt"])
                said = True
            time.sleep(POLL_S)

    # -- what the attempt's end means ----------------------------------------------------------------
    def _outcome(self, plan: dict, t0: float, results: dict) -> int | None:
        s = self.sup
        events = events_since(s.run_dir, t0)
        config = [e for e in events if e.get("event") == "stop" and e.get("config_error")]
        if config:
            self._end("stopped", 2, config[-1]["why"])
            raise UsageError(config[-1]["why"])
        others = [n["id"] for n in plan["nodes"] if n["id"] != s.node_id]
        # Leaving: a node whose supervisor said so (its own SIGTERM/SIGINT), gone since or not. Lost: a
        # supervisor gone without a word (killed, with its process group or the machine), even when its
        # ranks, signalled by the dying supervisor's launcher, stopped after their step like a leaving
        # node's: that was called `left`, with no fault record.
        leaving = [n for n in others if (s.board.node(n) or {}).get("leaving")]
        lost = [n for n in others if n not in leaving and not s.board.alive(n)]
        all_ok = not lost and all(r is not None and r.get("rc") == 0 for r in results.values())
        if s._signal is not None:
            return self._stopped(t0)
        if self.scaling and all_ok:
            self.reason = "scale up: more ranks offered"
            return None
        # A stop record: some rank got SIGTERM/SIGINT and every rank stopped after the step. From a node
        # leaving: go on without it. From outside every supervisor (a scheduler signalling the ranks): stop.
        # A launcher that was itself killed (no result, or rc < 0) took its ranks with it: a fault.
        stops = [e for e in events if e.get("event") == "stop" and e.get("code") in (EXIT_PREEMPTED, EXIT_INTERRUPTED)]
        if stops and not lost and all(r is None or r.get("rc") == 0 for r in results.values()) and \
                (leaving or all_ok):
            if leaving:
                gone = leaving
                s.event("node_left", nodes=gone, latest=latest_pointer(s.run_dir), attempt=plan["attempt"])
                log.warning("elastic: node %s left the run (%s): going on without it from %s", ", ".join(gone),
                            stops[-1].get("why", "its ranks stopped"), latest_pointer(s.run_dir))
                self.reason = f"node {', '.join(gone)} left"
                return None
            return self._stopped(t0)
        if all_ok:
            s.event("finished", ranks=plan["world"])
            self._end("finished", 0, "finished")
            return 0
        return self._fault(plan, events, results, lost)

    def _fault(self, plan: dict, events: list, results: dict, lost: list) -> None:
        s = self.sup
        records = [e for e in events if e.get("event") == "fault" and isinstance(e.get("detected_by"), int)]
        fault = name_fault(plan, results, lost, records)
        s.record(fault.record(plan["attempt"]))
        rcs = {n: (r or {}).get("rc") for n, r in results.items()}
        s.event("fault", ranks=plan["world"], exit=rcs.get(s.node_id), exits=rcs, cause=fault.kind, node=fault.node,
                failed_ranks=sorted({r["rank"] for r in records if r.get("rank") is not None}), attempt=plan["attempt"])
        also = f"; {fault.collateral} other rank(s) stopped with it" if fault.collateral else ""
        if not s.budget.spend():
            s.say(f"fault in attempt {plan['attempt']}: {fault.why}{also}")
            self._end("gave_up", 1, fault.why)
            raise TrainError(f"elastic: giving up: the restart budget is spent ({s.budget.max_restarts} restarts "
                             f"{'within %g s' % s.budget.window_s if s.budget.window_s else 'over the run'}, "
                             "--max-restarts / --restart-window); resume with --resume")
        s.say(f"fault in attempt {plan['attempt']}: {fault.why}{also}; relaunching ({s.budget.describe()})")
        ran = {n["id"]: n["nproc"] for n in plan["nodes"]}
        self.caps = {node: max(0, ran.get(node, 0) - k) for node, k in fault.drop.items()}
        self.reason = f"fault: {fault.why}"

    def _stopped(self, t0: float) -> int:
        """One line for a run stopped by a signal (the rank 0 stop record says whether it saved) and its code."""
        s = self.sup
        recs = [e for e in events_since(s.run_dir, t0) if e.get("event") == "stop"]
        rec = recs[-1] if recs else {}
        if s._signal == signal.SIGINT:
            code = EXIT_INTERRUPTED
        else:
            code = EXIT_PREEMPTED if rec.get("code") == EXIT_PREEMPTED else EXIT_TERMINATED
        why = rec.get("why") or f"stopped by {signal.Signals(s._signal or signal.SIGTERM).name} before any rank " \
            f"finished a step; last checkpoint {latest_pointer(s.run_dir) or 'none'}"
        s.event("stopped", exit=code, why=why)
        self._end("stopped", code, why)
        s.say(f"{why}; resume: {s.resume_cmd}")
        return code
