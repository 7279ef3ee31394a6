"""Several nodes over one origin, coordinated by a real redis-server."""

from __future__ import annotations

import os
import shutil
import subprocess
import signal
import sys
import threading
import time
from collections import Counter

import pytest
import redis
from tests.cache.cache_helpers import counter, settled, wait_for
from tests.conftest import free_port

from loongforge.shared.dataset import load_shard_index
from loongforge.shared.synthetic import make_synthetic_root

pytestmark = pytest.mark.slow


def _bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


@pytest.fixture
def root8(tmp_path):
    root = str(tmp_path / "origin")
    make_synthetic_root(root, lengths=(62,) * 8, shard_size=1)  # 8 shards of 42 KiB
    return root, load_shard_index(root)


def _read_all(daemon, names, ok: list, timeout=15.0):
    with daemon.client(timeout=timeout) as c:
        for n in names:
            ok.append(bytes(c.read_shard(n)) == _bytes(daemon.root, n) and not c.degraded)


def test_two_nodes_missing_the_same_shards_read_origin_once_each(root8, redis_server, daemons):
    root, index = root8
    names = [s.name for s in index.shards]
    slow = {"LOONGFORGE_CACHE_ORIGIN_DELAY_S": "0.15"}  # widen the race: both nodes miss while one fills
    a = daemons(root, index, "node-a", redis_url=redis_server.url, env=slow)
    b = daemons(root, index, "node-b", redis_url=redis_server.url, env=slow)
    wait_for(lambda: a.stats()["redis"]["state"] == b.stats()["redis"]["state"] == "connected", what="redis")
    ok: list = []
    threads = [threading.Thread(target=_read_all, args=(d, names, ok)) for d in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert ok == [True] * (4 * len(names))
    sa, sb = a.stats(), b.stats()
    origin = counter(sa, "fills", "origin") + counter(sb, "fills", "origin")
    peer = counter(sa, "fills", "peer") + counter(sb, "fills", "peer")
    # Documented bound: <= 1 origin read per shard while Redis is up and no lock holder dies.
    reasons = (sa["counters"]["origin_reads"], sb["counters"]["origin_reads"])
    assert origin == len(names), (origin, peer, reasons)
    assert peer == len(names)  # the other node got each shard from its peer
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prefix = sa["redis"]["prefix"]
    for n in names:
        assert r.smembers(prefix + f"dir:{n}") == {"node-a", "node-b"}
    assert r.smembers(prefix + "nodes") == {"node-a", "node-b"}
    wait_for(lambda: r.zcard(prefix + "hot") == len(names), what="hotness counters")
    assert int(r.zscore(prefix + "hot", names[0])) >= 4


def test_lock_holder_dies_mid_fill_a_waiter_takes_over(synthetic_root, redis_server, daemons):
    root, index = synthetic_root
    name = index.shards[0].name
    lock = ("--lock-ttl-s", "1")
    a = daemons(root, index, "node-a", redis_url=redis_server.url, extra=lock,
                env={"LOONGFORGE_CACHE_ORIGIN_DELAY_S": "30"})
    b = daemons(root, index, "node-b", redis_url=redis_server.url, extra=lock)
    wait_for(lambda: a.stats()["redis"]["state"] == b.stats()["redis"]["state"] == "connected", what="redis")
    def doomed_get():
        with pytest.raises(ConnectionError):  # node-a is killed while this request waits
            a.request("get", shard=name)

    threading.Thread(target=doomed_get, daemon=True).start()
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    lock_key = a.stats()["redis"]["prefix"] + f"lock:{name}"
    wait_for(lambda: r.exists(lock_key), what="node-a to take the fill lock")
    time.sleep(1.5)  # past one TTL: the keep-alive must have extended the live holder's lock
    assert r.exists(lock_key)
    a.stop(signal.SIGKILL)  # holder dies mid-fill; its lock is not released
    t0 = time.monotonic()
    with b.client(timeout=10.0) as c:
        assert bytes(c.read_shard(name)) == _bytes(root, name) and not c.degraded
    waited = time.monotonic() - t0
    assert waited < 1 + 5.0  # lock TTL (1 s) + slack for a busy 2-core box; fill_timeout_s is 120 s
    assert counter(b.stats(), "fills", "origin") == 1  # bound: 1 + one dead holder (which never finished)


def test_redis_killed_then_restarted(synthetic_root, redis_server, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, redis_url=redis_server.url)
    wait_for(lambda: d.stats()["redis"]["state"] == "connected", what="redis")
    with d.client(timeout=5.0) as c:
        c.read_shard(s[0])
        redis_server.stop()
        t0 = time.monotonic()
        for n in s[1:3]:
            assert bytes(c.read_shard(n)) == _bytes(root, n) and not c.degraded  # still served, from origin
        assert time.monotonic() - t0 < 5.0
    st = wait_for(lambda: (x := d.stats())["redis"]["state"] == "down" and x, what="redis state down")
    assert counter(st, "fills", "origin") == 3 and sum(st["counters"]["redis_errors"].values()) >= 1
    redis_server.start()  # empty: no persistence, the node must re-register and re-publish
    st = wait_for(lambda: (x := d.stats())["redis"]["state"] == "connected" and x["redis"]["registrations"] >= 2
                  and x, timeout=15, what="re-registration")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prefix = st["redis"]["prefix"]
    assert r.exists(prefix + "node:node-a")
    assert {n for n in s[:3] if r.sismember(prefix + f"dir:{n}", "node-a")} == set(s[:3])


def test_redis_password_acl_user_and_wrong_password(synthetic_root, tmp_path, redis_server, daemons):
    root, index = synthetic_root
    redis_server.stop()
    server = type(redis_server)(tmp_path, password="s3cret").start()  # tests/conftest.py RedisServer
    try:
        admin = redis.Redis(port=server.port, password="s3cret")
        admin.acl_setuser("cachenode", enabled=True, passwords=["+nodepw"], keys=["loongforge:*"],
                          commands=["+@all"])
        by_password = daemons(root, index, "node-p", redis_url=server.url)
        by_acl = daemons(root, index, "node-u", redis_url=f"redis://cachenode:nodepw@127.0.0.1:{server.port}/0")
        wrong = daemons(root, index, "node-w", redis_url=f"redis://:nope@127.0.0.1:{server.port}/0")
        for d in (by_password, by_acl):
            wait_for(lambda d=d: d.stats()["redis"]["state"] == "connected", what=f"{d.name} auth")
        assert admin.exists(by_acl.stats()["redis"]["prefix"].encode() + b"node:node-u")
        missing = daemons(root, index, "node-m", redis_url=f"redis://127.0.0.1:{server.port}/0")
        with wrong.client(timeout=5.0) as c:  # auth failure degrades, never stops serving
            assert bytes(c.read_shard(index.shards[0].name)) == _bytes(root, index.shards[0].name)
        for d, says in ((wrong, "invalid username-password"), (missing, "AuthenticationError")):
            st = d.stats()
            assert st["redis"]["state"] == "down" and says in st["redis"]["last_error"], st["redis"]
            # logged once, at start, as an ERROR that names where the password goes
            errors = [ln for ln in d.log().splitlines() if " ERROR loongforge.cache.coord" in ln]
            assert len(errors) == 1 and "--redis-url" in errors[0] and "LOONGFORGE_CACHE_REDIS_PASSWORD" in errors[0]
        table = subprocess.run([sys.executable, "-m", "loongforge.cache", "stats", "--socket", wrong.socket],
                               capture_output=True, text=True, timeout=30)
        assert "last redis error" in table.stdout and "AuthenticationError" in table.stdout
    finally:
        server.stop()


def _tls_certs(d) -> tuple[str, str, str]:
    """A private CA and a server cert for 127.0.0.1, made with the openssl CLI."""
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=loongforge-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "ext")
    return str(d / "ca.crt"), str(d / "server.crt"), str(d / "server.key")


def test_rediss_tls_url(synthetic_root, tmp_path, redis_server, daemons):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed: cannot make a test certificate")
    root, index = synthetic_root
    ca, cert, key = _tls_certs(tmp_path)
    port = redis_server.port
    redis_server.stop()  # reuse its free port for a TLS-only server
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--tls-cert-file",
                             cert, "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no",
                             "--requirepass", "tlspw", "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://:tlspw@127.0.0.1:{port}/0"
        wait_for(lambda: _tls_ping(url, ca), what="TLS redis-server")
        d = daemons(root, index, redis_url=url, env={"LOONGFORGE_CACHE_REDIS_CA_CERTS": ca})
        wait_for(lambda: d.stats()["redis"]["state"] == "connected", what="rediss:// connection")
        with d.client() as c:
            c.read_shard(index.shards[0].name)
        r = redis.Redis.from_url(url, ssl_ca_certs=ca, decode_responses=True)
        assert r.smembers(d.stats()["redis"]["prefix"] + f"dir:{index.shards[0].name}") == {"node-a"}
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _tls_ping(url, ca) -> bool:
    try:
        return redis.Redis.from_url(url, ssl_ca_certs=ca, socket_timeout=0.5).ping()
    except redis.RedisError:
        return False


def test_redis_unreachable_at_start_is_logged_and_shown(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index, redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    st = d.stats()
    assert st["redis"]["state"] == "down" and "Connection refused" in st["redis"]["last_error"], st["redis"]
    warnings = [ln for ln in d.log().splitlines() if " WARNING loongforge.cache.coord" in ln]
    assert len(warnings) == 1 and "Connection refused" in warnings[0]


def _dir(r, prefix, names) -> dict:
    return {n: r.smembers(prefix + f"dir:{n}") for n in names}


def test_directory_stays_exact_across_restarts_with_wiped_tiers(root8, redis_server, daemons):
    """Both nodes hold everything; one is killed, the other stopped, both lose their SSD. After the
    restart nobody may be asked for a shard it no longer holds: every origin read is a `lock` read."""
    root, index = root8
    names = [s.name for s in index.shards]
    a = daemons(root, index, "node-a", redis_url=redis_server.url)
    b = daemons(root, index, "node-b", redis_url=redis_server.url)
    for d in (a, b):
        wait_for(lambda d=d: d.stats()["redis"]["state"] == "connected", what=f"{d.name} redis")
        ok: list = []
        _read_all(d, names, ok)
        assert ok == [True] * len(names)
        settled(d)
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prefix = a.stats()["redis"]["prefix"]
    assert _dir(r, prefix, names) == {n: {"node-a", "node-b"} for n in names}
    assert b.stop() == 0  # graceful: deregisters
    assert _dir(r, prefix, names) == {n: {"node-a"} for n in names}
    a.stop(signal.SIGKILL)  # no deregistration: its entries stay until it registers again
    for d in (a, b):
        shutil.rmtree(d.ssd_dir)
    a.start()
    b.start()
    for d in (a, b):
        wait_for(lambda d=d: d.stats()["redis"]["registrations"] >= 1, what=f"{d.name} registration")
    assert _dir(r, prefix, names) == {n: set() for n in names}
    for d in (a, b):
        ok = []
        _read_all(d, names, ok)
        assert ok == [True] * len(names)
    sa, sb = a.stats(), b.stats()
    reasons = Counter(sa["counters"]["origin_reads"]) + Counter(sb["counters"]["origin_reads"])
    assert reasons == {"lock": len(names)}, reasons  # no peer_failed, no no_live_holder
    assert counter(sb, "fills", "peer") == len(names)
    settled(a), settled(b)
    assert _dir(r, prefix, names) == {n: {"node-a", "node-b"} for n in names}
