"""Who takes part in an elastic run across nodes: one supervisor per node, all on the shared run dir,
coordinated through files under RUN_DIR/elastic/ (no service of their own).

    RUN_DIR/run.lock               the leader: the supervisor holding the run lock (runlock.py) plans every
                                   launch; the others follow. When the leader dies the kernel (or the NFS
                                   lock manager) drops its lock and the first follower to take it leads.
    elastic/nodes/ID.lock          flock held by node ID's supervisor for its life: a second supervisor
                                   with the same --node-id exits 2; the leader tests it to tell a live
                                   node from a lost one (no clock is compared across hosts)
    elastic/nodes/ID.json          the node's state: host, addr, pid, ranks it offers now (`nproc`: its
                                   --nproc-per-node capped by its --capacity-file), the last launch it
                                   finished (`ready_after`), and `leaving` (it got SIGTERM/SIGINT)
    elastic/plan.json              the leader's decision: attempt K's nodes and their ranks, world, grad
                                   accum, rendezvous endpoint and id, the checkpoint to resume; or the
                                   run's end (`state`: finished | stopped | gave_up, with `code`)
    elastic/results/S-K-ID.json    what node ID's launch of attempt K (leader session S) returned
                                   (agent.py's result)

Every file is written whole (temp file + rename), so a reader sees the old or the new one. A plan
is followed only while its leader holds the run lock (`session` names the leader's pid and host).
Locks hold where runlock.py says flock holds (local filesystems, NFSv3/v4, CephFS, GPFS, Lustre
with -o flock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import time

from loongforge.shared.errors import UsageError
from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.resilience.runlock import lock_file_held

PLAN_STATES = ("launch", "finished", "stopped", "gave_up")


class Board:
    """This node's view of the shared elastic/ directory."""

    def __init__(self, run_dir: str, node_id: str):
        self.root = os.path.join(run_dir, "elastic")
        self.node_id = node_id
        self._fd: int | None = None

    # -- this node ---------------------------------------------------------------------------------
    def join(self, state: dict) -> None:
        """Take this node's lock (a second supervisor for the same node id: UsageError, exit 2) and
        publish its state."""
        os.makedirs(self._nodes_dir(), exist_ok=True)
        fd = os.open(self._lock_path(self.node_id), os.O_RDWR | os.O_CREAT, 0o644)
        for _ in range(20):  # the leader's liveness test holds it for microseconds
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                time.sleep(0.05)
        else:
            os.close(fd)
            other = self.node(self.node_id) or {}
            raise UsageError(f"--node-id {self.node_id} already has a live supervisor on this run dir (pid "
                             f"{other.get('pid')} on {other.get('host')}): one supervisor per node; give each node "
                             "its own --node-id")
        self._fd = fd
        self.publish(state)

    def publish(self, state: dict) -> None:
        write_bytes_atomic(self._state_path(self.node_id),
                           json.dumps({**state, "id": self.node_id, "t": time.time()}).encode())

    def leave(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # -- every node --------------------------------------------------------------------------------
    def alive(self, node_id: str) -> bool:
        """Its supervisor holds its lock (this node: True while joined)."""
        if node_id == self.node_id:
            return self._fd is not None
        return lock_file_held(self._lock_path(node_id))

    def node(self, node_id: str) -> dict | None:
        return _read_json(self._state_path(node_id))

    def live_nodes(self) -> list[dict]:
        """The state of every node whose supervisor is alive, this one first, then by id."""
        out = []
        for path in glob.glob(os.path.join(self._nodes_dir(), "*.json")):
            doc = _read_json(path)
            if doc and self.alive(doc["id"]):
                out.append(doc)
        return sorted(out, key=lambda d: (d["id"] != self.node_id, d["id"]))

    # -- the plan and the launches' results ----------------------------------------------------------
    def write_plan(self, plan: dict) -> None:
        assert plan["state"] in PLAN_STATES, plan
        os.makedirs(self.root, exist_ok=True)
        write_bytes_atomic(os.path.join(self.root, "plan.json"), json.dumps({**plan, "t": time.time()}).encode())

    def read_plan(self) -> dict | None:
        return _read_json(os.path.join(self.root, "plan.json"))

    def write_result(self, session: str, attempt: int, result: dict) -> None:
        os.makedirs(os.path.join(self.root, "results"), exist_ok=True)
        write_bytes_atomic(self._result_path(session, attempt, self.node_id), json.dumps(result).encode())

    def read_result(self, session: str, attempt: int, node_id: str) -> dict | None:
        return _read_json(self._result_path(session, attempt, node_id))

    def drop_results(self, keep_session: str) -> None:
        """The leader at its start: results of earlier sessions are done with (bookkeeping, not the run)."""
        for path in glob.glob(os.path.join(self.root, "results", "*.json")):
            if not os.path.basename(path).startswith(f"{keep_session}-"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # -- paths -------------------------------------------------------------------------------------
    def _nodes_dir(self) -> str:
        return os.path.join(self.root, "nodes")

    def _lock_path(self, node_id: str) -> str:
        return os.path.join(self._nodes_dir(), f"{node_id}.lock")

    def _state_path(self, node_id: str) -> str:
        return os.path.join(self._nodes_dir(), f"{node_id}.json")

    def _result_path(self, session: str, attempt: int, node_id: str) -> str:
        return os.path.join(self.root, "results", f"{session}-{attempt}-{node_id}.json")


def split_ranks(offers: list[tuple[str, int]], *, max_ranks: int, group: int) -> list[tuple[str, int]]:
    """The ranks each node runs: in offer order (the leader first), no more than max_ranks in all, and a
    multiple of group (tp x sp) in all, trimmed from the last nodes. Nodes left with 0 are not listed."""
    out, total = [], 0
    for node, n in offers:
        n = max(0, min(n, max_ranks - total))
        out.append([node, n])
        total += n
    extra = total % group
    for item in reversed(out):
        cut = min(item[1], extra)
        item[1] -= cut
        extra -= cut
    return [(node, n) for node, n in out if n > 0]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
