"""Name the fault that ended an elastic launch, in one line, from what the supervisor sees: which
nodes' supervisors are gone (nodes.py), what each node's launcher returned (agent.py: every failed
rank with its exit code or signal), and the fault records the ranks' watchdogs wrote.

What counts as the cause, first match wins:
1. a node lost: its supervisor is gone (its node lock was released: the machine or the process died);
2. a watchdog record: a rank with no heartbeat (dead or stopped), a hung step, a dead torchrun agent,
   no first step within --startup-timeout-s: what the ranks themselves saw;
3. a rank killed by a signal (SIGKILL: the OOM killer or a kill; SIGSEGV ...);
4. a rank that exited with a code other than EXIT_PEER_FAULT (its own traceback is on the console);
5. a launcher that failed: the rendezvous (a node did not join in time), or the launcher killed.
Ranks that exited with EXIT_PEER_FAULT only saw a peer go (exits.py); they are collateral, never the
cause. The watchdog names the ranks to drop (`drop`); a rank killed outright frees its slot and the
node's capacity file says whether it can be used again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.train.resilience.exits import EXIT_PEER_FAULT

WATCHDOG_PREFIX = {"hang": "hung: "}  # the other kinds' `why` says what happened already


@dataclass
class Fault:
    kind: str  # node_lost | dead | hang | launcher | startup | signal | exit | rendezvous | unknown
    why: str  # one line, names the node and rank
    node: str | None = None
    rank: int | None = None
    drop: dict[str, int] = field(default_factory=dict)  # node -> ranks the watchdog named (not relaunched)
    collateral: int = 0  # ranks that only saw a peer go (EXIT_PEER_FAULT)

    def record(self, attempt: int) -> dict:
        """The supervisor's {"event": "fault"} record (metrics.jsonl)."""
        return {"v": 1, "event": "fault", "kind": self.kind, "rank": self.rank, "node": self.node, "why": self.why,
                "attempt": attempt, "detected_by": "supervisor"}


def name_fault(plan: dict, results: dict[str, dict | None], lost: list[str], records: list[dict]) -> Fault:
    """plan: the attempt's plan (nodes.py); results: node id -> its launcher's result (None: none came);
    lost: nodes whose supervisor is gone; records: the attempt's watchdog / start-up fault records."""
    failures = [(node, f) for node, res in results.items() if res for f in res.get("failures", [])]
    collateral = sum(1 for _, f in failures if f["exitcode"] == EXIT_PEER_FAULT)
    drop: dict[str, int] = {}
    for rec in records:
        if rec.get("rank") is not None and rec.get("kind") in ("dead", "hang"):
            node = rec.get("node") or _node_of(rec["rank"], failures) or "?"
            drop[node] = drop.get(node, 0) + 1
    ranks = {n["id"]: n["nproc"] for n in plan.get("nodes", [])}
    if lost:
        node = lost[0]
        more = f" (and {', '.join(lost[1:])})" if lost[1:] else ""
        return Fault("node_lost", f"node {node}{more} lost ({ranks.get(node, '?')} rank(s)): its supervisor is "
                     "gone (the machine or its processes died)", node=node, drop=drop, collateral=collateral)
    if records:
        rec = records[0]
        rank = rec.get("rank")
        node = rec.get("node") or (None if rank is None else _node_of(rank, failures))
        who = f"rank {rank} on node {node or rec.get('host', '?')}" if rank is not None else \
            f"node {node or rec.get('host', '?')}"
        prefix = WATCHDOG_PREFIX.get(rec.get("kind"), "")
        return Fault(rec.get("kind", "unknown"), f"{who}: {prefix}{rec.get('why', '')} (watchdog of rank "
                     f"{rec.get('detected_by')})", node=node, rank=rank, drop=drop, collateral=collateral)
    by_signal = [(node, f) for node, f in failures if f.get("signal")]
    own = [(node, f) for node, f in failures if not f.get("signal") and f["exitcode"] != EXIT_PEER_FAULT]
    for kind, picked in (("signal", by_signal), ("exit", own)):
        if picked:
            node, f = picked[0]
            how = f"killed by {f['signal']}" if kind == "signal" else f"exited with code {f['exitcode']}"
            return Fault(kind, f"rank {f['rank']} on node {node} (pid {f['pid']}) {how}", node=node, rank=f["rank"],
                         drop=drop, collateral=collateral)
    for node, res in results.items():
        if res is not None and res.get("error"):
            kind = "rendezvous" if res["error"].startswith("rendezvous") else "launcher"
            return Fault(kind, f"node {node}: {res['error']}", node=node, drop=drop, collateral=collateral)
    if failures:  # only collateral exits: the peer that went first left no trace
        node, f = failures[0]
        return Fault("exit", f"rank {f['rank']} on node {node} lost its peers (exit {f['exitcode']}); no rank "
                     "named a cause", node=node, rank=f["rank"], drop=drop, collateral=collateral)
    codes = {node: res.get("rc") for node, res in results.items() if res is not None}
    return Fault("unknown", f"launch ended without a named cause (launcher exit codes {codes})", drop=drop)


def _node_of(rank: int, failures: list[tuple[str, dict]]) -> str | None:
    return next((node for node, f in failures if f["rank"] == rank), None)
