"""Plan-aware cache policy, pure: no I/O, no clocks, no threads.

LoongForge's sample order is deterministic, so each rank can announce the
shards it will read. With the future known, the best eviction is Belady's:
drop the shard whose next use is farthest away. Shards nobody announced fall
back to LRU (and go first: no known future use beats any known one).

The daemon (store.py) and the trace replay (benchmarks/loader/cache.py, tests) both
drive this module, so the policy measured is the policy deployed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# How far ahead in a plan a `get` may land and still count as "the rank is
# here now". Workers read a few shards out of order (parallel data workers).
CONSUME_LOOKAHEAD = 64


@dataclass(slots=True)
class _Plan:
    epoch: int
    shards: tuple[str, ...]
    positions: dict[str, list[int]]
    cursor: int = 0  # index of the next shard this rank has not read yet

    @classmethod
    def build(cls, epoch: int, shards: list[str]) -> "_Plan":
        positions: dict[str, list[int]] = {}
        for i, s in enumerate(shards):
            positions.setdefault(s, []).append(i)
        return cls(epoch, tuple(shards), positions)

    @property
    def remaining(self) -> int:
        return len(self.shards) - self.cursor


@dataclass
class PlanBook:
    """Announced plans per rank, each with a cursor advanced by reads."""

    plans: dict[int, list[_Plan]] = field(default_factory=dict)  # rank -> plans sorted by epoch

    def announce(self, rank: int, epoch: int, shards: list[str]) -> None:
        plans = [p for p in self.plans.get(rank, []) if p.epoch != epoch]
        plans.append(_Plan.build(epoch, list(shards)))
        plans.sort(key=lambda p: p.epoch)
        self.plans[rank] = plans

    def consume(self, shard: str, rank: int | None = None) -> None:
        """A reader asked for `shard`: move that rank's cursor past it. Without
        a rank, every plan that expects the shard soon advances."""
        for r in ([rank] if rank is not None else list(self.plans)):
            self._consume_rank(r, shard)

    def _consume_rank(self, rank: int, shard: str) -> None:
        plans = self.plans.get(rank)
        if not plans:
            return
        for i, plan in enumerate(plans):
            pos = plan.positions.get(shard, ())
            j = bisect.bisect_left(pos, plan.cursor)
            if j < len(pos) and pos[j] - plan.cursor < CONSUME_LOOKAHEAD:
                plan.cursor = pos[j] + 1
                del plans[:i]  # the rank moved on to this epoch: older plans are done
                if plan.remaining == 0 and len(plans) > 1:
                    del plans[0]
                return
            if plan.remaining >= CONSUME_LOOKAHEAD:
                return  # not expected soon in this plan; do not skip to a later epoch

    def next_use(self, shard: str) -> int | None:
        """Reads until some rank next needs `shard` (0 = next), None if no plan has it."""
        best = None
        for plans in self.plans.values():
            offset = 0
            for plan in plans:
                pos = plan.positions.get(shard)
                if pos:
                    j = bisect.bisect_left(pos, plan.cursor)
                    if j < len(pos):
                        d = offset + pos[j] - plan.cursor
                        best = d if best is None else min(best, d)
                        break
                offset += plan.remaining
                if best is not None and offset >= best:
                    break
        return best

    def upcoming(self, window: int) -> list[str]:
        """The next `window` shards of every rank, nearest first, deduplicated."""
        seqs = []
        for plans in self.plans.values():
            seq: list[str] = []
            for plan in plans:
                seq.extend(plan.shards[plan.cursor: plan.cursor + window - len(seq)])
                if len(seq) >= window:
                    break
            seqs.append(seq)
        out, seen = [], set()
        for d in range(window):
            for seq in seqs:
                if d < len(seq) and seq[d] not in seen:
                    seen.add(seq[d])
                    out.append(seq[d])
        return out

    def summary(self) -> dict:
        return {str(r): [{"epoch": p.epoch, "cursor": p.cursor, "length": len(p.shards)} for p in plans]
                for r, plans in self.plans.items()}


class Policy:
    """Victim choice for one tier: farthest next use, LRU for the unannounced.
    `plan_aware=False` gives plain LRU (the baseline the benchmark compares)."""

    def __init__(self, plans: PlanBook | None = None, *, plan_aware: bool = True):
        self.plans = plans if plans is not None else PlanBook()
        self.plan_aware = plan_aware
        self._tick = 0
        self._last_use: dict[str, int] = {}

    def touch(self, shard: str) -> None:
        self._tick += 1
        self._last_use[shard] = self._tick

    def forget(self, shard: str) -> None:
        self._last_use.pop(shard, None)

    def rank_key(self, shard: str) -> tuple[int, float]:
        """Sort key: the largest key is evicted first."""
        lru_age = -self._last_use.get(shard, 0)
        if not self.plan_aware:
            return (0, lru_age)
        d = self.plans.next_use(shard)
        return (1, lru_age) if d is None else (0, d)

    def victim(self, candidates, exclude=()) -> str | None:
        best, best_key = None, None
        for s in candidates:
            if s in exclude:
                continue
            key = self.rank_key(s)
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best

    def worth_prefetching(self, target: str, victim: str) -> bool:
        """Prefetch `target` over `victim` only if the victim is needed later
        (Belady admission); otherwise prefetching would cause a miss."""
        if not self.plan_aware:
            return True
        d_t, d_v = self.plans.next_use(target), self.plans.next_use(victim)
        return d_t is not None and (d_v is None or d_v > d_t)
