"""Cross-node coordination through Redis: node heartbeats, a directory of who
holds which shard, single-flight fills, hotness counters, announced plans.

Redis is an optimisation, never a dependency: every method degrades to "no
coordination" when Redis is unreachable, and reconnection is paced by a
redis-py backoff object (no sleep loops, no request waits on a dead server).

Single-flight fill (see PROTOCOL.md, "Fill coordination"):
  1. A node that misses shard S looks up the directory: a live holder -> fetch
     from that peer over HTTP (hash-verified), origin untouched.
  2. Otherwise it tries `SET lock:S token NX PX ttl`. The winner reads origin,
     keeps the lock alive (PEXPIRE every ttl/3) while it fills, then
     atomically adds itself to the directory and deletes the lock.
  3. Losers poll (every POLL_S, bounded by fill_timeout) until a holder
     appears (-> peer fetch) or the lock vanishes (-> they retry step 2).
  If the holder dies mid-fill its keep-alive stops, the lock expires after at
  most lock_ttl_s and one waiter takes over. Bound: origin reads of a shard <=
  1 + (number of lock holders that died or lost Redis mid-fill), while Redis
  is up; while Redis is down, <= 1 per node.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from typing import Callable

log = logging.getLogger(__name__)
POLL_S = 0.05

# KEYS[1] = lock:<shard>, KEYS[2] = dir:<shard>
# ARGV[1] = token, ARGV[2] = lock TTL ms, ARGV[3] = "1" to take the lock even if holders exist
# Returns {acquired (1 = we hold the lock now, 0 = not), holder node ids...}
ACQUIRE = """
local holders = redis.call('SMEMBERS', KEYS[2])
if #holders > 0 and ARGV[3] ~= '1' then
  return {0, unpack(holders)}
end
local ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if ok then return {1, unpack(holders)} end
return {0, unpack(holders)}
"""

# KEYS[1] = lock:<shard>; ARGV[1] = token, ARGV[2] = TTL ms
# Returns 1 if the TTL was extended (we still hold the lock), 0 if we lost it.
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] = lock:<shard>, KEYS[2] = dir:<shard>, KEYS[3] = held:<node>
# ARGV[1] = token ('' when we filled without the lock), ARGV[2] = node id, ARGV[3] = shard
# Adds the node to the shard's directory and releases our lock in one step, so
# a waiter never sees "no lock and no holder" for a completed fill.
# Returns 1 if our lock was released, 0 if we held none (expired or never taken).
PUBLISH = """
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1] = lock:<shard>; ARGV[1] = token. Compare-and-delete after a failed fill.
# Returns 1 if deleted, 0 if the lock was not ours.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] = node:<id>, KEYS[2] = nodes (set of ids)
# ARGV[1] = node id, ARGV[2] = info JSON, ARGV[3] = TTL ms
# Returns 1 if the node key was absent (first start, expiry, or a Redis restart
# wiped it: the caller must re-publish its holdings), else 0.
HEARTBEAT = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return 1 - existed
"""

# KEYS[1] = held:<node>
# ARGV[1] = key prefix, ARGV[2] = node id, ARGV[3..] = every shard the node holds now (RAM or SSD)
# Makes the directory exact for this node in one step: the node leaves dir:<s> of every shard it
# no longer holds (RAM wiped at start, SSD entries dropped by the rebuild, evictions while Redis
# was away) and joins dir:<s> of every shard it holds; held:<node> becomes exactly the list.
# dir:<s> keys are built from ARGV[1], not passed in KEYS (the old members are only known inside
# the script): fine on the single Redis instance infra/redis deploys, not on Redis Cluster.
# Returns {entries removed, entries now held}.
REGISTER = """
local keep = {}
for i = 3, #ARGV do keep[ARGV[i]] = true end
local removed = 0
for _, s in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if not keep[s] then
    redis.call('SREM', ARGV[1] .. 'dir:' .. s, ARGV[2])
    removed = removed + 1
  end
end
redis.call('DEL', KEYS[1])
for i = 3, #ARGV do
  redis.call('SADD', ARGV[1] .. 'dir:' .. ARGV[i], ARGV[2])
  redis.call('SADD', KEYS[1], ARGV[i])
end
return {removed, #ARGV - 2}
"""

# KEYS[1] = held:<node>, KEYS[2] = node:<id>, KEYS[3] = nodes
# ARGV[1] = key prefix, ARGV[2] = node id
# Graceful stop: the node leaves every dir:<s> it is in (keys built from ARGV[1], as in REGISTER),
# its held set and heartbeat key go, and it leaves `nodes`. Returns the number of entries removed.
DEREGISTER = """
local held = redis.call('SMEMBERS', KEYS[1])
for _, s in ipairs(held) do redis.call('SREM', ARGV[1] .. 'dir:' .. s, ARGV[2]) end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return #held
"""


class Coordinator:
    """Redis side of one node. `state` is 'disabled' (no URL), 'connected' or 'down'."""

    def __init__(self, cfg, namespace: str, metrics, holdings: Callable[[], list[str]]):
        self.cfg = cfg
        self.node = cfg.node_id
        self.metrics = metrics
        self.holdings = holdings  # shards this node can serve, for re-publishing
        self.prefix = f"{cfg.redis_prefix}:{namespace}:"
        self.peer_addr: str | None = None
        self.state = "disabled"
        self.registrations = 0
        self.registered = False  # the directory holds exactly our holdings (set by _register)
        self.last_error: str | None = None  # shown by `cache stats`
        self._logged_error: str | None = None  # kind of failure already logged since the last success
        self._changes = itertools.count()  # bumped by every publish/drop: a registration racing one redoes
        self._change = 0
        self._failures = 0
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._hot: dict[str, int] = {}
        self.client = None
        if cfg.redis_url:
            self._connect()

    # -- connection and degradation ------------------------------------------
    def _connect(self) -> None:
        import redis
        from redis.backoff import ExponentialWithJitterBackoff
        from redis.retry import Retry

        self._redis = redis
        # Reconnect pacing between health probes; compute(failures) -> seconds.
        self._backoff = ExponentialWithJitterBackoff(cap=5.0, base=0.1)
        options = dict(socket_timeout=self.cfg.redis_timeout_s, socket_connect_timeout=self.cfg.redis_timeout_s,
                       retry=Retry(ExponentialWithJitterBackoff(cap=0.2, base=0.02), retries=1),
                       retry_on_error=[redis.ConnectionError, redis.TimeoutError], health_check_interval=10,
                       decode_responses=True)
        if self.cfg.redis_username:
            options["username"] = self.cfg.redis_username
        if self.cfg.redis_password:
            options["password"] = self.cfg.redis_password
        if self.cfg.redis_url.startswith("rediss://") and self.cfg.redis_ca_certs:
            options["ssl_ca_certs"] = self.cfg.redis_ca_certs
        self.client = redis.from_url(self.cfg.redis_url, **options)
        self.scripts = {name: self.client.register_script(src) for name, src in
                        (("acquire", ACQUIRE), ("extend", EXTEND), ("publish", PUBLISH),
                         ("release", RELEASE), ("heartbeat", HEARTBEAT), ("register", REGISTER),
                         ("deregister", DEREGISTER))}
        self.state = "down"  # until the first heartbeat succeeds

    def available(self) -> bool:
        """True if Redis should be used now. While down, probes at most once
        per backoff interval, so requests never wait on a dead server."""
        if self.state == "connected":
            return True
        if self.state == "disabled" or time.monotonic() < self._next_try:
            return False
        with self._lock:
            if self.state == "connected":
                return True
            try:
                self.client.ping()
            except self._redis.RedisError as exc:
                self._failed("ping", exc)
                return False
            self.state = "connected"
            self._failures = 0
            self._logged_error = None
            self.metrics.redis_up.set(1)
            log.info("redis %s reachable: coordination on", self._where())
        return True

    def _failed(self, op: str, exc: Exception) -> None:
        self._failures += 1
        self._next_try = time.monotonic() + self._backoff.compute(self._failures)
        self.metrics.inc("redis_errors", op)
        self.metrics.redis_up.set(0)
        self.last_error = f"{op}: {type(exc).__name__}: {exc}"
        # Log the first failure of each kind, including the very first one at start (the state
        # starts as "down", so logging only changes of state would hide a bad password forever).
        kind = type(exc).__name__
        if kind != self._logged_error:
            self._logged_error = kind
            if isinstance(exc, (self._redis.AuthenticationError, self._redis.exceptions.NoPermissionError)):
                log.error("redis %s refused this node (%s: %s): fix the user/password in --redis-url or "
                          "LOONGFORGE_CACHE_REDIS_PASSWORD (ACL user: LOONGFORGE_CACHE_REDIS_USERNAME); serving "
                          "without coordination until then", self._where(), kind, exc)
            else:
                log.warning("redis %s unreachable (%s: %s): serving without coordination, reconnecting with "
                            "backoff", self._where(), kind, exc)
        self.state = "down"

    def _where(self) -> str:
        kw = self.client.connection_pool.connection_kwargs
        return f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"

    def _call(self, op: str, fn, default=None):
        if not self.available():
            return default
        try:
            return fn()
        except self._redis.RedisError as exc:
            self._failed(op, exc)
            return default

    # -- heartbeat, directory, hotness, plans --------------------------------
    def heartbeat(self) -> None:
        """Refresh the node key; after a Redis restart, re-register and re-publish."""
        info = json.dumps({"node": self.node, "peer": self.peer_addr, "time": time.time()})
        ttl_ms = int(self.cfg.node_ttl_s * 1000)
        new = self._call("heartbeat", lambda: self.scripts["heartbeat"](
            keys=[self.prefix + f"node:{self.node}", self.prefix + "nodes"], args=[self.node, info, ttl_ms]))
        if new is not None and (new or not self.registered):
            self._register()  # first contact since start, or Redis lost our keys (restart, expiry)
        with self._lock:
            hot, self._hot = self._hot, {}
        if hot:
            def flush():
                pipe = self.client.pipeline(transaction=False)
                for shard, n in hot.items():
                    pipe.zincrby(self.prefix + "hot", n, shard)
                pipe.execute()
            self._call("hot", flush)

    def _register(self) -> None:
        """Replace this node's directory entries with its holdings. A publish or drop that runs
        between reading the holdings and the script could be undone by it, so redo if one did."""
        for _ in range(5):
            seen = self._change
            held = self.holdings()
            out = self._call("register", lambda: self.scripts["register"](
                keys=[self.prefix + f"held:{self.node}"], args=[self.prefix, self.node, *held]))
            if out is None:
                return  # Redis failed: the next successful heartbeat registers again
            if self._change == seen:
                break
        self.registered = True
        self.registrations += 1
        log.info("registered node %s in redis: %d shards published, %d stale entries removed",
                 self.node, out[1], out[0])

    def _changed(self) -> None:
        self._change = next(self._changes)

    def touch(self, shard: str) -> None:
        with self._lock:
            self._hot[shard] = self._hot.get(shard, 0) + 1

    def dropped(self, shard: str) -> None:
        """This node no longer holds `shard` in any tier."""
        self._changed()

        def run():
            pipe = self.client.pipeline(transaction=True)
            pipe.srem(self.prefix + f"dir:{shard}", self.node)
            pipe.srem(self.prefix + f"held:{self.node}", shard)
            pipe.execute()
        self._call("drop", run)

    def announce(self, rank: int, epoch: int, shards: list[str]) -> None:
        def run():
            key = self.prefix + f"plan:{self.node}:{rank}:{epoch}"
            pipe = self.client.pipeline(transaction=True)
            pipe.set(key, json.dumps(shards), ex=86400)
            pipe.zadd(self.prefix + "plans", {key: time.time()})
            pipe.execute()
        self._call("announce", run)

    def deregister(self) -> None:
        """Graceful stop: leave the directory, so no peer asks this node for a shard after it is gone."""
        self._call("deregister", lambda: self.scripts["deregister"](
            keys=[self.prefix + f"held:{self.node}", self.prefix + f"node:{self.node}", self.prefix + "nodes"],
            args=[self.prefix, self.node]))

    def live_peers(self, nodes: list[str]) -> list[str]:
        """Peer addresses of live nodes among `nodes` (excluding this one)."""
        others = [n for n in nodes if n != self.node]
        if not others:
            return []
        infos = self._call("peers", lambda: self.client.mget([self.prefix + f"node:{n}" for n in others]), [])
        addrs = []
        for raw in infos or []:
            if raw:
                peer = json.loads(raw).get("peer")
                if peer:
                    addrs.append(peer)
        return addrs

    def snapshot(self) -> dict:
        return {"state": self.state, "node": self.node, "peer": self.peer_addr, "registrations": self.registrations,
                "failures": self._failures, "last_error": self.last_error, "prefix": self.prefix}

    # -- single-flight fill ---------------------------------------------------
    def fill(self, shard: str, from_origin: Callable[[], bytes], from_peer: Callable[[str], bytes],
             deadline: float) -> tuple[bytes, str, str]:
        """Bytes of `shard` (verified by the callbacks), their source ('peer' or
        'origin') and the lock token to pass to `finish` ('' if none)."""
        token = uuid.uuid4().hex
        lock_key, dir_key = self.prefix + f"lock:{shard}", self.prefix + f"dir:{shard}"
        ttl_ms = int(self.cfg.lock_ttl_s * 1000)
        while time.monotonic() < deadline:
            if not self.available():
                self.metrics.inc("origin_reads", "uncoordinated")
                return from_origin(), "origin", ""  # uncoordinated: <= 1 origin read per node
            try:
                acquired, *holders = self.scripts["acquire"](keys=[lock_key, dir_key], args=[token, ttl_ms, "0"])
                reason = "lock"
                if holders:
                    peers = self.live_peers(holders)
                    reason = "peer_failed" if peers else "no_live_holder"
                    for addr in peers:
                        try:
                            return from_peer(addr), "peer", ""
                        except Exception as exc:  # noqa: BLE001 - any peer failure: try the next source
                            log.warning("peer %s could not serve %s (%s); trying another source", addr, shard, exc)
                    if not peers:
                        log.warning("directory lists %s for %s but none is live with a peer address (stale "
                                    "entries of dead daemons); reading the origin", holders, shard)
                if not acquired and holders:
                    # Every listed holder failed us: take the lock despite them. Never force when there
                    # were no holders: the lock owner may publish between the two calls, and a forced
                    # take would then read origin a second time.
                    acquired, *_ = self.scripts["acquire"](keys=[lock_key, dir_key], args=[token, ttl_ms, "1"])
            except self._redis.RedisError as exc:
                self._failed("fill", exc)
                continue
            if acquired:
                self.metrics.inc("origin_reads", reason)
                with _KeepAlive(self, lock_key, token, ttl_ms):
                    try:
                        return from_origin(), "origin", token
                    except BaseException:
                        self._call("release", lambda: self.scripts["release"](keys=[lock_key], args=[token]))
                        raise
            time.sleep(POLL_S)  # another node is filling: poll for its result (bounded by deadline)
        raise TimeoutError(f"fill of {shard} did not finish before the fill timeout")

    def finish(self, shard: str, token: str, published: bool) -> None:
        """After placing the bytes: join the directory and release the lock atomically."""
        lock_key = self.prefix + f"lock:{shard}"
        if published:
            self._changed()
            self._call("publish", lambda: self.scripts["publish"](
                keys=[lock_key, self.prefix + f"dir:{shard}", self.prefix + f"held:{self.node}"],
                args=[token, self.node, shard]))
        elif token:
            self._call("release", lambda: self.scripts["release"](keys=[lock_key], args=[token]))


class _KeepAlive:
    """Extends a fill lock every ttl/3 while the holder lives; a dead holder
    stops extending, so the lock expires and a waiter takes over."""

    def __init__(self, coord: Coordinator, key: str, token: str, ttl_ms: int):
        self.coord, self.key, self.token, self.ttl_ms = coord, key, token, ttl_ms
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fill-lock-keepalive")

    def _run(self) -> None:
        while not self.stop.wait(self.ttl_ms / 3000):
            ok = self.coord._call("extend", lambda: self.coord.scripts["extend"](
                keys=[self.key], args=[self.token, self.ttl_ms]))
            if not ok:
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
