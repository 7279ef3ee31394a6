"""Our torchrun: the elastic supervisor starts each node's ranks through this wrapper, which runs
torchrun's own launcher (torch.distributed.run) in this process, so that what the launcher says is
ours to route:

    python -m loongforge.train.resilience.elastic.agent --result FILE --log FILE [--run-dir R --peers a,b] \
        -- TORCHRUN ARGS...

* torchrun's agent logs (rendezvous chatter, "Sending process N closing signal SIGTERM", its
  failure summary) go to the node's log FILE, not the console; the ranks' own output still reaches
  the console (they inherit this process's stdout and stderr);
* torchrun's exceptions are caught and their tracebacks go to the log file: ChildFailedError (a
  rank failed), SignalException (this process was signalled: the supervisor died, PR_SET_PDEATHSIG),
  a rendezvous error (the other nodes did not come within the join timeout);
* torchrun's exit barrier (a node's agent waits for every other's once its ranks are done) also ends
  when a node of the attempt is gone (--run-dir, --peers: its supervisor's lock is free), instead of
  waiting out 300 s for an agent that died;
* the outcome goes to the result FILE as JSON, which the supervisor reads to name the failed rank
  and why: {"rc", "failures": [{"rank", "local_rank", "pid", "exitcode", "signal"}], "error"}.

Exit code: 0, 1 (a rank failed), 3 (rendezvous), or 128 + the signal.

    python -m loongforge.train.resilience.elastic.agent --standby

imports as above and waits for its launch on stdin (one JSON line: the environment and the arguments a
fresh agent of that launch gets): the supervisor keeps one standing by, so that a relaunch after a fault does not wait for
this process's interpreter and torch (supervisor.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback

# This process's own C++ warnings (its rendezvous store client when a node is gone: "recvValueWithTimeout
# failed" with a 30-frame stack) go nowhere: torch reads the level once, as it loads, and the ranks get
# the caller's setting back below (restore_cpp_log_level).
USER_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
# torch installs its own stderr handlers on import: imported before route_logs replaces them.
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import parse_args, run as torchrun  # noqa: E402

from loongforge.shared.storage import write_bytes_atomic  # noqa: E402
from loongforge.train.resilience.elastic.nodes import Board  # noqa: E402
from loongforge.train.resilience.exits import NODE_ENV  # noqa: E402

EXIT_RENDEZVOUS = 3
EXIT_BARRIER = "loongforge/exit_barrier"  # this attempt's store is fresh (a new rendezvous id and port)
BARRIER_POLL_S = 0.5


def route_logs(path: str) -> None:
    """torch's loggers (torchrun's agent and the rendezvous) to `path` only; torch installs its own
    stderr handler on "torch" and "torch.distributed", so those are replaced, not just added to."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {os.environ.get(NODE_ENV, '')} agent "
                                           "%(process)d %(name)s: %(message)s"))
    for name in ("", "torch", "torch.distributed"):
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.propagate = False
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("torch").setLevel(logging.INFO)


def restore_cpp_log_level() -> None:
    """The ranks (which inherit this environment) log C++ warnings as the caller asked."""
    if USER_CPP_LOG_LEVEL is None:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = USER_CPP_LOG_LEVEL


def exit_barrier_while_nodes_live(run_dir: str, peers: list[str]):
    """torchrun's exit barrier, which keeps the agent hosting the rendezvous store alive until every
    node's agent is done, ends also as soon as a node of the attempt is gone (its supervisor's lock is
    free: nodes.py). torch's waited its full 300 s for an agent that had died: a follower whose process
    group was killed (its agent, in a session of its own, got SIGTERM from the dying supervisor and left
    without checking in) held the leader silent for 300 s after its ranks had finished. Returns the
    method that replaces SimpleElasticAgent._exit_barrier."""
    board = Board(run_dir, os.environ.get(NODE_ENV, ""))
    log = logging.getLogger("loongforge.agent")

    def _exit_barrier(agent: SimpleElasticAgent) -> None:
        store, size = agent._store, agent._worker_group.group_world_size
        deadline = time.monotonic() + agent._exit_barrier_timeout
        try:
            if store.add(f"{EXIT_BARRIER}/arrived", 1) >= size:
                store.set(f"{EXIT_BARRIER}/all", "1")
            while time.monotonic() < deadline:
                if store.check([f"{EXIT_BARRIER}/all"]):
                    return
                gone = [p for p in peers if not board.alive(p)]
                if gone:
                    log.info("exit barrier: node %s is gone; not waiting for it", ", ".join(gone))
                    return
                time.sleep(BARRIER_POLL_S)
            log.info("exit barrier: not every node checked in within %.0f s", agent._exit_barrier_timeout)
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's host is gone: nobody is left to wait for
            log.info("exit barrier: the rendezvous store is gone (%s: %s)", type(exc).__name__, exc)

    return _exit_barrier


def failures_of(exc) -> list[dict]:
    """ChildFailedError.failures (global rank -> ProcessFailure) as plain records, first failure first."""
    out = []
    for rank, f in sorted(exc.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        out.append({"rank": int(rank), "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None, "t": f.timestamp})
    return out


def run(torchrun_argv: list[str], result_path: str) -> int:
    log = logging.getLogger("loongforge.agent")
    result: dict = {"rc": 0, "failures": [], "error": None, "node": os.environ.get(NODE_ENV), "pid": os.getpid()}
    try:
        torchrun(parse_args(torchrun_argv))
    except ChildFailedError as exc:
        result.update(rc=1, failures=failures_of(exc))
        log.info("ranks failed:\n%s", traceback.format_exc())
    except SignalException as exc:
        result.update(rc=128 + int(exc.sigval), error=f"the launcher got {signal.Signals(exc.sigval).name}")
        log.info("signalled:\n%s", traceback.format_exc())
    except RendezvousError as exc:
        result.update(rc=EXIT_RENDEZVOUS, error=f"rendezvous: {type(exc).__name__}: {' '.join(str(exc).split())}")
        log.info("rendezvous failed:\n%s", traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - the supervisor reports it in one line; the traceback is in the log
        result.update(rc=1, error=f"launcher: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        log.info("launcher failed:\n%s", traceback.format_exc())
    result["t"] = time.time()
    write_bytes_atomic(result_path, json.dumps(result).encode())
    return result["rc"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loongforge.train.resilience.elastic.agent")
    p.add_argument("--result", help="JSON outcome for the supervisor")
    p.add_argument("--log", help="the node's log file: torchrun's own output")
    p.add_argument("--run-dir", default=None, help="the run dir whose elastic/ board says which nodes live")
    p.add_argument("--peers", default="", help="the attempt's other nodes (comma-separated ids)")
    p.add_argument("--standby", action="store_true", help="imports done, wait for the launch on stdin: one JSON "
                   "line {env, argv}: this process's environment and arguments for it (the supervisor's next "
                   "launch; EOF: exit 0, nothing launched)")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    args = p.parse_args(argv)
    rest = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    if args.standby:
        line = sys.stdin.readline()
        if not line:
            return 0
        job = json.loads(line)
        os.environ.clear()  # the launch's environment and arguments, as a fresh agent started for it has them
        os.environ.update(job["env"])
        return main(job["argv"])
    if not (args.result and args.log):
        p.error("--result and --log are required (or --standby)")
    route_logs(args.log)
    restore_cpp_log_level()
    if args.run_dir:
        SimpleElasticAgent._exit_barrier = exit_barrier_while_nodes_live(args.run_dir, [p for p in args.peers.split(",")
                                                                                       if p])
    return run(rest, args.result)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # torchrun's worker-tail threads must not hold the exit
