"""Interval arithmetic on a profiler timeline, and the GPU step partition built on it.

Within one step [lo, hi) every instant of the GPU timeline falls in exactly one class:
  compute          some non-communication kernel runs (any stream)
  exposed comm     only communication kernels run: time a collective adds to the step.
                   Communication that runs under compute (overlap_comm) is not a wait.
  waiting on peers the part of exposed comm that is this rank's collective spinning until
                   the last peer arrives (see peer_wait_intervals)
  data wait        no kernel runs and the host is blocked in next(loader)
  launch overhead  no kernel runs and the host is not waiting on data: Python, dispatch,
                   launch latency, host syncs
so the five add up to the step. Intervals are (start, end) pairs, any unit.
"""

from __future__ import annotations

Interval = tuple[float, float]


def merge(intervals) -> list[Interval]:
    """Sorted, disjoint union of the intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    end = None
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if end is not None and a <= end:
            if b > end:
                end = b
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
            end = b
    return out


def length(intervals) -> float:
    return _total(merge(intervals))


def _total(merged: list[Interval]) -> float:
    """Length of a sorted, disjoint union (merge's output; intersect's and subtract's too)."""
    return sum(b - a for a, b in merged)


def clip(intervals, lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def intersect(x, y) -> list[Interval]:
    x, y = merge(x), merge(y)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x, y) -> list[Interval]:
    """x minus y, in one sweep over both sorted unions (a step holds ~10^5 kernels)."""
    out, y, j = [], merge(y), 0
    for a, b in merge(x):
        while j < len(y) and y[j][1] <= a:  # ends before this x: before every later x too
            j += 1
        k = j
        while k < len(y) and y[k][0] < b and a < b:
            c, d = y[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            k += 1
        if b > a:
            out.append((a, b))
    return out


def partition_step(lo: float, hi: float, *, compute, comm, data_wait=(), peer_wait=None) -> dict:
    """The step's five classes (module docstring); peer_wait=None: not separable, reported as None."""
    k = merge(clip(compute, lo, hi))
    c_all = merge(clip(comm, lo, hi))
    exposed = subtract(c_all, k)
    waiting = intersect(exposed, clip(peer_wait, lo, hi)) if peer_wait is not None else []
    idle = subtract([(lo, hi)], k + c_all)
    data = intersect(idle, clip(data_wait, lo, hi))
    return {"step": hi - lo, "compute": _total(k), "comm_exposed": _total(exposed) - _total(waiting),
            "peer_wait": _total(waiting) if peer_wait is not None else None,
            "comm_overlapped": _total(c_all) - _total(exposed), "data_wait": _total(data),
            "launch_overhead": _total(idle) - _total(data)}


def peer_wait_intervals(ranks: list[list[Interval]]) -> list[list[Interval]] | None:
    """Per rank, the head of each collective spent waiting for the slowest peer.

    ranks[r] = rank r's collective kernels of one step, in issue order (NCCL issues the same
    collectives in the same order on every rank). A collective ends at about the same time on
    all ranks, once the last one has joined, so its duration on rank r minus the shortest
    duration among the ranks is how long r spun waiting: [start, start + dur - min dur].
    Durations only, so the ranks' clocks need not agree. None when the ranks' lists do not
    match (one rank's trace missing or cut differently): then it cannot be separated."""
    if len(ranks) < 2 or len({len(r) for r in ranks}) != 1:
        return None
    out: list[list[Interval]] = [[] for _ in ranks]
    for k in range(len(ranks[0])):
        shortest = min(b - a for a, b in (r[k] for r in ranks))
        for r, kernels in enumerate(ranks):
            a, b = kernels[k]
            if b - a > shortest:
                out[r].append((a, a + (b - a - shortest)))
    return out
