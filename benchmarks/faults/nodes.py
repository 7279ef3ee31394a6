"""The fault of benchmarks/faults/run.py across nodes: the run is two "nodes" on this machine, each its
own elastic supervisor with one rank (`--nodes 2 --nproc-per-node 1 --node-id a|b`, its own TMPDIR and
torch extensions dir), on one run dir; the suite's Run is node a, which leads (holds the run lock).

* node_loss: once node a leads and the run has trained, every process of node b (supervisor, launcher,
  rank) is SIGKILLed at once, as when the machine dies. Node a must name the lost node in one line and
  a fault record, and finish the run alone (1 rank, grad accum 2, the same global batch) from the last
  checkpoint: every sample once, none lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from loongforge.train.resilience.owner import descendants
from loongforge.train.resilience.runlock import holder

NODE_ARGS = ("--nodes", "2", "--nproc-per-node", "1", "--node-addr", "127.0.0.1", "--rdzv-timeout-s", "120")


def node_args(node_id: str) -> tuple:
    return (*NODE_ARGS, "--node-id", node_id)


def f_node_loss(run):
    deadline = time.monotonic() + 300
    while holder(run.run_dir).get("pid") != run.proc.pid:  # node a leads before node b starts
        if run.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("node a never took the run lock")
        time.sleep(0.1)
    local = os.path.join(os.path.dirname(run.run_dir), "node-b")
    os.makedirs(local, exist_ok=True)
    args = list(run.args)
    args[args.index("--node-id") + 1] = "b"
    env = {**run.env, "TMPDIR": local, "TORCH_EXTENSIONS_DIR": os.path.join(local, "ext")}
    b = subprocess.Popen(args, env=env, stdout=run.log, stderr=subprocess.STDOUT, start_new_session=True)
    run.wait_steps(5)
    t = run.mark_fault()
    pids = [b.pid, *descendants(b.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    b.wait()
    run.note = {"node_b_processes_killed": len(pids)}
    return t


def annotate_node_loss(row: dict, run, setup) -> None:
    rows = run.rows()
    faults = [r for r in rows if r.get("event") == "fault" and r.get("kind") == "node_lost"]
    launches = [r for r in rows if r.get("event") == "elastic" and r.get("action") == "launch"]
    log = open(run.log.name, errors="replace").read()
    said = [ln for ln in log.splitlines() if ln.startswith("loongforge train: fault") and "node b lost" in ln]
    row.update(getattr(run, "note", {}))
    if faults:
        row["detected_after_s"] = round(faults[0]["t"] - row["t_inject"], 1)
    ok = bool(faults and said and len(launches) == 2 and launches[1].get("nodes") == {"a": 1})
    row["action"] = (f"node b SIGKILLed ({row.get('node_b_processes_killed')} processes: supervisor, launcher, "
                     f"rank); node a named it in one line and a fault record (node_lost), relaunched alone on "
                     f"{launches[-1]['ranks']} rank, grad accum {launches[-1]['grad_accum']}, from "
                     f"{launches[-1].get('latest')}" if ok else
                     f"CHECK FAILED: fault records {faults}, lines {said}, launches {[la.get('nodes') for la in launches]}")
    row["recovered"] = bool(row["recovered"] and ok)

