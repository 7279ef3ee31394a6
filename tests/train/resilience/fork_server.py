"""A fork server for test_forks.py: the real ForkServer, with fork_main.main as its "rank" entry instead of
the trainer (no heavy imports). `python fork_server.py SOCKET [--thread] [--room ...]`."""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from loongforge.train.resilience.elastic import forks  # noqa: E402
from tests.train.resilience import fork_main  # noqa: E402

if __name__ == "__main__":
    sock = forks.listen(sys.argv[1])
    if "--thread" in sys.argv:  # what forks.fork_safe refuses: a second thread in the server
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    print("ready", flush=True)
    forks.ForkServer(sock, {"rank": ("tests.train.resilience.fork_main", fork_main.main)}).serve()
