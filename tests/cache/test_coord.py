"""Narrow tests of the single-flight fill protocol against a real redis-server.
Two Coordinators stand for two nodes; a hook between Redis calls replays an
interleaving that full-daemon tests hit only by chance."""

from __future__ import annotations

import time

from loongforge.cache.config import CacheConfig
from loongforge.cache.coord import Coordinator
from loongforge.cache.metrics import Metrics


def _node(redis_url: str, node: str) -> Coordinator:
    cfg = CacheConfig(origin="/unused", redis_url=redis_url, node_id=node, fill_timeout_s=5.0)
    coord = Coordinator(cfg, "ns-test", Metrics(node), holdings=lambda: [])
    coord.peer_addr = f"{node}.invalid:1"
    coord.heartbeat()
    assert coord.state == "connected"
    return coord


def test_waiter_never_forces_the_lock_when_the_owner_publishes_between_calls(redis_server):
    """Node B misses while A holds the lock; A publishes right after B's first
    acquire. B must then copy from A, not take the freed lock and read origin."""
    a, b = _node(redis_server.url, "node-a"), _node(redis_server.url, "node-b")
    shard = "shards/s0.tar"
    token = "a-token"
    ok, *_ = a.scripts["acquire"](keys=[a.prefix + f"lock:{shard}", a.prefix + f"dir:{shard}"],
                                  args=[token, 30000, "0"])
    assert ok == 1
    real_acquire = b.scripts["acquire"]
    calls = []

    def acquire_then_a_publishes(**kw):
        out = real_acquire(**kw)
        calls.append(kw["args"][2])
        if len(calls) == 1:
            a.finish(shard, token, published=True)  # A completes its fill in the window
        return out

    b.scripts["acquire"] = acquire_then_a_publishes
    origin, peer = [], []
    data, source, _ = b.fill(shard, from_origin=lambda: origin.append(1) or b"o",
                             from_peer=lambda addr: peer.append(addr) or b"p",
                             deadline=time.monotonic() + 5)
    assert (data, source) == (b"p", "peer")
    assert origin == [] and peer == ["node-a.invalid:1"]
    assert "1" not in calls  # never the forced take
    assert b.metrics.snapshot()["origin_reads"] == {}


def test_holders_that_all_fail_allow_one_origin_read_with_the_reason(redis_server):
    a, b = _node(redis_server.url, "node-a"), _node(redis_server.url, "node-b")
    shard = "shards/s1.tar"
    a.finish(shard, "", published=True)  # A is listed as a holder, but its peer server is unreachable

    def broken_peer(addr):
        raise ConnectionError(f"{addr} refused")

    data, source, token = b.fill(shard, from_origin=lambda: b"o", from_peer=broken_peer,
                                 deadline=time.monotonic() + 5)
    assert (data, source) == (b"o", "origin") and token
    assert b.metrics.snapshot()["origin_reads"] == {"peer_failed": 1}
    b.finish(shard, token, published=True)
    r = b.client
    assert r.smembers(b.prefix + f"dir:{shard}") == {"node-a", "node-b"}
    assert not r.exists(b.prefix + f"lock:{shard}")


def test_a_holder_without_a_live_node_key_counts_as_gone(redis_server):
    a, b = _node(redis_server.url, "node-a"), _node(redis_server.url, "node-b")
    shard = "shards/s2.tar"
    a.finish(shard, "", published=True)
    a.client.delete(a.prefix + "node:node-a")  # node key expired: A died without deregistering
    data, source, _ = b.fill(shard, from_origin=lambda: b"o", from_peer=lambda addr: b"p",
                             deadline=time.monotonic() + 5)
    assert source == "origin"
    assert b.metrics.snapshot()["origin_reads"] == {"no_live_holder": 1}


def test_deregister_and_registration_make_the_directory_exact(redis_server):
    """Graceful stop leaves every dir:<s>; a (re)registration replaces the node's entries with
    exactly what it holds (a restart that lost its RAM tier and part of its SSD)."""
    holdings = ["shards/s0.tar", "shards/s1.tar", "shards/s2.tar"]
    cfg = CacheConfig(origin="/unused", redis_url=redis_server.url, node_id="node-a", fill_timeout_s=5.0)
    a = Coordinator(cfg, "ns-test", Metrics("node-a"), holdings=lambda: list(holdings))
    a.heartbeat()
    r = a.client
    assert all(r.smembers(a.prefix + f"dir:{s}") == {"node-a"} for s in holdings)
    a.deregister()
    assert not any(r.exists(a.prefix + f"dir:{s}") for s in holdings) and not r.exists(a.prefix + "held:node-a")
    a.heartbeat()  # a new process on the same node id: first registration replaces
    assert r.smembers(a.prefix + "held:node-a") == set(holdings)
    restarted = Coordinator(cfg, "ns-test", Metrics("node-a"), holdings=lambda: ["shards/s1.tar"])
    restarted.heartbeat()  # node key still alive (killed within node_ttl_s): must register anyway
    assert r.smembers(a.prefix + "held:node-a") == {"shards/s1.tar"}
    assert [s for s in holdings if r.sismember(a.prefix + f"dir:{s}", "node-a")] == ["shards/s1.tar"]
