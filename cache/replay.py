"""Replay a read trace through the cache policy without any I/O.

Time advances in steps; in each step every rank reads its next shard. Before
the reads, the prefetcher may fill up to `fills_per_step` shards (origin
bandwidth, in shards per step). A read is a hit if its shard is resident.
Used by benchmarks/loader/cache.py and tests/cache/test_policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.cache.policy import PlanBook, Policy


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayResult:
    name: str
    reads: tuple[int, ...]  # per epoch
    hits: tuple[int, ...]  # per epoch
    origin_fills: int
    evictions: int

    def hit_rate(self, epoch: int | None = None) -> float:
        if epoch is None:
            return sum(self.hits) / max(1, sum(self.reads))
        return self.hits[epoch] / max(1, self.reads[epoch])


class _Sim:
    def __init__(self, sizes: dict[str, int], capacity: int, policy: Policy):
        self.sizes, self.capacity, self.policy = sizes, capacity, policy
        self.resident: set[str] = set()
        self.used = 0
        self.fills = self.evictions = 0

    def place(self, shard: str, protect: set[str], prefetch: bool) -> bool:
        size = self.sizes[shard]
        while self.used + size > self.capacity:
            victim = self.policy.victim(self.resident, exclude=protect)
            if victim is None or (prefetch and not self.policy.worth_prefetching(shard, victim)):
                return False
            self.resident.discard(victim)
            self.policy.forget(victim)
            self.used -= self.sizes[victim]
            self.evictions += 1
        self.resident.add(shard)
        self.used += size
        self.fills += 1
        self.policy.touch(shard)
        return True


def replay(epochs: list[dict[int, list[str]]], sizes: dict[str, int], capacity: int, *, plan_aware: bool,
           window: int = 0, fills_per_step: float = 0, horizon: int | None = None, name: str = "") -> ReplayResult:
    """`epochs[e][rank]` = the shards rank reads in epoch e. With horizon=None
    every epoch's plan is announced up front (the order is deterministic);
    with horizon=H each rank re-announces only its next H reads every step
    (a rolling plan). `plan_aware=False` ignores plans for eviction (LRU) but
    still prefetches when window > 0. `fills_per_step` may be fractional."""
    plans = PlanBook()
    if horizon is None:
        for e, ranks in enumerate(epochs):
            for rank, seq in ranks.items():
                plans.announce(rank, e, seq)
    sim = _Sim(sizes, capacity, Policy(plans, plan_aware=plan_aware))
    reads, hits = [], []
    credit = 0.0
    for e, ranks in enumerate(epochs):
        n_reads = n_hits = 0
        for t in range(max((len(s) for s in ranks.values()), default=0)):
            if horizon is not None:
                for rank, seq in ranks.items():
                    plans.announce(rank, e, seq[t: t + horizon])
            credit = min(credit + fills_per_step, 1.0 + fills_per_step)  # idle bandwidth barely banks up
            credit -= _prefetch(sim, plans, window, int(credit))
            for rank in sorted(ranks):
                if t >= len(ranks[rank]):
                    continue
                shard = ranks[rank][t]
                n_reads += 1
                if shard in sim.resident:
                    n_hits += 1
                    sim.policy.touch(shard)
                else:
                    sim.place(shard, {shard}, prefetch=False)
                plans.consume(shard, rank)
        reads.append(n_reads)
        hits.append(n_hits)
    return ReplayResult(name=name or ("plan-aware" if plan_aware else "lru"), reads=tuple(reads),
                        hits=tuple(hits), origin_fills=sim.fills, evictions=sim.evictions)


def _prefetch(sim: _Sim, plans: PlanBook, window: int, budget: int) -> int:
    """Fill up to `budget` upcoming shards; returns how many were filled."""
    if window <= 0 or budget <= 0:
        return 0
    filled = 0
    protect: set[str] = set()
    for shard in plans.upcoming(window):
        protect.add(shard)  # never evict a shard the window is about to need
        if shard in sim.resident:
            continue
        if filled == budget or not sim.place(shard, protect, prefetch=True):
            break
        filled += 1
    return filled
