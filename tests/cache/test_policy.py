"""The pure policy: plan bookkeeping, Belady victims, trace replay, shard order."""

from __future__ import annotations

import numpy as np

from loongforge.cache.policy import PlanBook, Policy
from loongforge.cache.replay import replay


def test_next_use_and_cursor_follow_reads():
    plans = PlanBook()
    plans.announce(0, 0, ["a", "b", "c", "a"])
    plans.announce(1, 0, ["c", "d"])
    assert [plans.next_use(x) for x in "abcde"] == [0, 1, 0, 1, None]
    plans.consume("a", rank=0)
    assert plans.next_use("a") == 2  # its second use, two reads away for rank 0
    plans.consume("c")  # no rank: rank 1 expects c next, rank 0 expects it soon
    assert plans.next_use("c") is None and plans.next_use("d") == 0
    assert plans.upcoming(2) == ["a", "d"]


def test_epochs_chain_and_finished_plans_drop():
    plans = PlanBook()
    plans.announce(0, 0, ["a", "b"])
    plans.announce(0, 1, ["b", "a"])
    assert plans.next_use("a") == 0 and plans.upcoming(3) == ["a", "b"]
    for x in ("a", "b", "b"):
        plans.consume(x, rank=0)
    assert plans.next_use("a") == 0 and plans.next_use("b") is None
    assert [p["epoch"] for p in plans.summary()["0"]] == [1]


def test_victim_is_farthest_next_use_and_unannounced_go_first_by_lru():
    plans = PlanBook()
    plans.announce(0, 0, ["a", "b", "c"])
    pol = Policy(plans)
    for x in ("x", "c", "y", "a", "b"):
        pol.touch(x)
    assert pol.victim(["a", "b", "c", "x", "y"]) == "x"  # unannounced, least recently used
    assert pol.victim(["a", "b", "c", "y"]) == "y"
    assert pol.victim(["a", "b", "c"]) == "c"  # farthest next use
    assert pol.victim(["a", "b", "c"], exclude={"c"}) == "b"
    assert Policy(plans, plan_aware=False).victim(["a", "b", "c"]) in {"a", "b", "c"}
    assert pol.worth_prefetching("a", "c") and not pol.worth_prefetching("c", "a")


def _two_epochs(num_shards, world, seed=7):
    """Per epoch a seeded shard permutation, ranks taking interleaved slices."""
    perms = [np.random.default_rng([seed, e]).permutation(num_shards) for e in range(2)]
    return [{r: [f"s{i}" for i in perm[r::world]] for r in range(world)} for perm in perms]


def test_plan_aware_eviction_beats_lru_on_a_two_epoch_trace():
    epochs = _two_epochs(120, 4)
    sizes = {f"s{i}": 1000 + 37 * (i % 5) for i in range(120)}  # unequal sizes, like real shards
    capacity = int(0.3 * sum(sizes.values()))
    lru = replay(epochs, sizes, capacity, plan_aware=False)
    belady = replay(epochs, sizes, capacity, plan_aware=True)
    assert lru.hit_rate(0) == belady.hit_rate(0) == 0.0  # every shard is new in epoch 1
    assert belady.hit_rate(1) > 2 * lru.hit_rate(1) and belady.hit_rate(1) > 0.2
    assert belady.origin_fills < lru.origin_fills
    prefetched = replay(epochs, sizes, capacity, plan_aware=True, window=4, fills_per_step=4)
    assert prefetched.hit_rate(1) >= 0.95


def test_rolling_horizon_and_limited_bandwidth():
    epochs = _two_epochs(60, 1)
    sizes = {f"s{i}": 1000 for i in range(60)}
    capacity = 18 * 1000
    rolling = replay(epochs, sizes, capacity, plan_aware=True, window=4, fills_per_step=0.5, horizon=8)
    full = replay(epochs, sizes, capacity, plan_aware=True, window=4, fills_per_step=0.5)
    lru = replay(epochs, sizes, capacity, plan_aware=False, window=4, fills_per_step=0.5)
    assert 0.4 < rolling.hit_rate(0) <= 0.6  # half the origin bandwidth needed: about half the reads hit
    assert full.hit_rate(1) > rolling.hit_rate(1) >= lru.hit_rate(1) - 0.05
