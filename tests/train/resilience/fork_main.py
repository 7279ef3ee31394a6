"""The main module of test_forks.py's ranks: what the fork server's child runs (`main(argv)`), and what a
plain `python -m tests.train.resilience.fork_main ARGV` runs when the server refuses (the fallback)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time


def report() -> None:
    """In a spawned worker: which module multiprocessing re-imported as the main one."""
    print(json.dumps({"mp_main": sys.modules["__mp_main__"].__spec__.name}), flush=True)


def _on_term(signum, frame):
    print("term", flush=True)
    os._exit(85)


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "sleep":  # before the first line: the tests signal it once they have read that line
        signal.signal(signal.SIGTERM, _on_term)
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                      "rank": os.environ.get("RANK"), "main": sys.modules["__main__"].__spec__.name}), flush=True)
    if what == "exit":
        return int(argv[1])
    if what == "spawn":
        p = multiprocessing.get_context("spawn").Process(target=report)
        p.start()
        p.join()
        return p.exitcode
    if what == "sleep":
        while True:
            time.sleep(0.05)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
