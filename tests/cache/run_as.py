"""`python tests/cache/run_as.py UID GID GROUPS ARGS...` = `python -m loongforge.cache ARGS...` as
another user. Started as root, it imports everything the command will need, then drops to the uid,
gid and supplementary groups (comma-separated gids) and runs the command: the interpreter on this
machine and on CI lives under /root (0700), so a process started as the user could not even load it,
and one that drops first could not import the standard library modules it loads later."""

from __future__ import annotations

import os
import sys

# What `serve`, `stats` and `stop` import after start-up (handlers, the peer fetch, metrics, fsspec's
# local filesystem), loaded while the standard library is still readable.
import concurrent.futures.thread  # noqa: F401
import email.parser  # noqa: F401
import encodings.idna  # noqa: F401
import http.client  # noqa: F401
import http.server  # noqa: F401
import urllib.request  # noqa: F401

import fsspec.implementations.local  # noqa: F401
import prometheus_client  # noqa: F401
import prometheus_client.exposition  # noqa: F401
import redis  # noqa: F401

import loongforge.cache.cli as cli
import loongforge.cache.daemon  # noqa: F401


def main() -> int:
    uid, gid = int(sys.argv[1]), int(sys.argv[2])
    groups = [int(g) for g in sys.argv[3].split(",") if g]
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    return cli.main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
