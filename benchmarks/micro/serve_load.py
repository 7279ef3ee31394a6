"""One client process of `loongforge bench serve`: sends the same get_action request back to back
through loongforge's PolicyClient and prints {"round_trip_s": [...]} (the timed requests) as JSON.

    python -m loongforge.benchmarks.micro.serve_load --port P --obs OBS.npz --requests 30 --warmup 3

Imports numpy and the client only (no torch), so a client's start-up and CPU stay small beside the
server it measures."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from loongforge.train.serve.client import PolicyClient


def load_observation(path: str) -> dict:
    """serve.py's flat npz ("video/front", "state/arm", "language/<key>") -> GR00T's nested observation."""
    obs: dict = {"video": {}, "state": {}, "language": {}}
    with np.load(path, allow_pickle=False) as z:
        for name in z.files:
            kind, key = name.split("/", 1)
            obs[kind][key] = [[str(t)] for t in z[name]] if kind == "language" else z[name]
    return obs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--obs", required=True)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--barrier", default=None, help="after the warm-up, write BARRIER.<pid> and wait for BARRIER to "
                   "exist (the benchmark starts every client's timed requests together)")
    a = p.parse_args(argv)
    obs = load_observation(a.obs)
    times = []
    with PolicyClient("127.0.0.1", a.port, timeout_ms=600_000) as client:
        for _ in range(a.warmup):
            client.get_action(obs)
        if a.barrier:
            open(f"{a.barrier}.{os.getpid()}", "w").close()
            deadline = time.monotonic() + 600  # the benchmark died: do not wait for ever
            while not os.path.exists(a.barrier):
                if time.monotonic() > deadline:
                    print(f"serve_load: no {a.barrier} within 600 s", file=sys.stderr)
                    return 1
                time.sleep(0.005)
        for _ in range(a.requests):
            t0 = time.perf_counter()
            client.get_action(obs)
            times.append(time.perf_counter() - t0)
    json.dump({"round_trip_s": times}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
