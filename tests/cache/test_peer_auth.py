"""The peer port serves shards only to holders of the deployment's secret (peer.py): every other
request gets 401 and a count in peer_refused{reason}; a node started without the secret, or with a
key file others may read, is refused at start."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from loongforge.cache.config import CacheConfig, load_config, parse_hostport
from loongforge.cache.peer import load_secret, sign
from loongforge.shared.errors import ConfigError
from tests.cache.cache_helpers import PEER_SECRET, counter, wait_for
from tests.conftest import free_port

pytestmark = pytest.mark.slow
INFRA = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "cache")
KEY = "5f0e8c2a9b41d7e36c18f4a0b92d5e7c3a61f08b4d9e2c75a1b3f6e08d4c29a7"  # as `openssl rand -hex 32` makes


def _peer_addr(daemon) -> str:
    return re.search(r", peer ([^)]+)\)", daemon.log()).group(1)


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, b"", dict(exc.headers)


def test_peer_port_refuses_every_read_not_signed_with_the_secret(synthetic_root, daemons):
    """`curl http://127.0.0.1:PORT/shard/...` used to return the whole shard to anyone on the host (and,
    with the shipped 0.0.0.0, the network). Unsigned, wrongly signed, stale and replayed requests now
    get 401 and a count; a request signed with the deployment's secret gets the bytes."""
    root, index = synthetic_root
    name = index.shards[0].name
    port = free_port()
    a = daemons(root, index, extra=("--peer-listen", "127.0.0.1:0", "--metrics-port", str(port)),
                env={"LOONGFORGE_CACHE_PEER_SECRET": PEER_SECRET})
    a.request("get", shard=name)  # a holds it
    path, addr = f"/shard/{name}", _peer_addr(a)
    url = f"http://{addr}{path}"
    status, body, headers = _get(url)
    assert (status, body, headers.get("WWW-Authenticate")) == (401, b"", "LoongForge-HMAC-SHA256")
    assert _get(url, sign(b"not-the-deployment-secret-0123456789", "GET", path, addr))[0] == 401
    assert _get(url, sign(PEER_SECRET.encode(), "GET", path, addr, now=time.time() - 600))[0] == 401
    signed = sign(PEER_SECRET.encode(), "GET", path, addr)
    status, body, _ = _get(url, signed)
    assert status == 200 and body == open(os.path.join(root, name), "rb").read()
    assert _get(url, signed)[0] == 401  # the same request again: a replay
    refused = a.stats()["counters"]["peer_refused"]
    assert refused == {"unsigned": 1, "bad_signature": 1, "stale": 1, "replayed": 1}, refused
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loongforge_cache_peer_refused_total{reason="unsigned"} 1.0' in metrics
    warnings = [line for line in a.log().splitlines() if " WARNING " in line and "peer port: refused" in line]
    assert len(warnings) == 4, warnings  # one per reason, not one per request


def test_request_signed_for_one_node_is_refused_by_another(synthetic_root, daemons):
    """Node b's signed request to node a, captured on the wire, replayed to b itself (which holds the
    shard too) within the window: a refused it as a replay, but b had never seen the nonce and
    answered 200 with the shard. The signature now covers the node it is for (the address it
    advertises), so at any other node it is a bad signature."""
    root, index = synthetic_root
    name = index.shards[0].name
    env = {"LOONGFORGE_CACHE_PEER_SECRET": PEER_SECRET}
    a = daemons(root, index, "node-a", extra=("--peer-listen", "127.0.0.1:0"), env=env)
    b = daemons(root, index, "node-b", extra=("--peer-listen", "127.0.0.1:0"), env=env)
    for node in (a, b):
        node.request("get", shard=name)  # both hold it
    path = f"/shard/{name}"
    captured = sign(PEER_SECRET.encode(), "GET", path, _peer_addr(a))  # b -> a, as b's fetch signs it
    assert _get(f"http://{_peer_addr(a)}{path}", captured)[0] == 200
    status, body, _ = _get(f"http://{_peer_addr(b)}{path}", captured)
    assert (status, body) == (401, b""), status
    assert counter(b.stats(), "peer_refused", "bad_signature") == 1
    fresh = sign(PEER_SECRET.encode(), "GET", path, _peer_addr(b))  # signed for b: served
    assert _get(f"http://{_peer_addr(b)}{path}", fresh)[0] == 200


def test_node_with_another_secret_reads_origin_and_is_counted(synthetic_root, redis_server, daemons):
    """A node whose secret is not the deployment's cannot read its peers: its fetch is refused (401,
    counted on the holder), it says why, and reads origin instead (origin_reads{peer_failed})."""
    root, index = synthetic_root
    name = index.shards[0].name
    a = daemons(root, index, "node-a", redis_url=redis_server.url)
    b = daemons(root, index, "node-b", redis_url=redis_server.url,
                env={"LOONGFORGE_CACHE_PEER_SECRET": "another-deployment-secret-0123456789"})
    wait_for(lambda: a.stats()["redis"]["state"] == b.stats()["redis"]["state"] == "connected", what="redis")
    a.request("get", shard=name)
    b.request("get", shard=name)
    sa, sb = a.stats(), b.stats()
    assert counter(sa, "peer_refused", "bad_signature") == 1 and counter(sb, "fills", "peer") == 0
    assert counter(sb, "origin_reads", "peer_failed") == 1, sb["counters"]["origin_reads"]
    assert "this node's peer secret is not the deployment's" in b.log()


def test_peer_listen_needs_the_secret_from_a_private_key_file(synthetic_root, tmp_path):
    root, _ = synthetic_root
    with pytest.raises(ConfigError, match="needs the deployment's shared secret"):
        CacheConfig(origin=root, peer_listen="127.0.0.1:7712")
    key = tmp_path / "peer.key"
    key.write_text(KEY + "\n")
    for mode, ok in ((0o644, False), (0o640, False), (0o600, True), (0o400, True)):
        os.chmod(key, mode)
        cfg = CacheConfig(origin=root, peer_listen="127.0.0.1:0", peer_secret_file=str(key))
        if ok:
            assert load_secret(cfg) == KEY.encode()
        else:
            with pytest.raises(ConfigError, match="readable by no one else"):
                load_secret(cfg)
    with pytest.raises(ConfigError, match="at least 32"):
        load_secret(CacheConfig(origin=root, peer_listen="127.0.0.1:0", peer_secret="short"))
    out = subprocess.run([sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--peer-listen",
                          "0.0.0.0:0", "--ram-dir", str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd"),
                          "--socket", str(tmp_path / "c.sock")], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "LOONGFORGE_CACHE_PEER_SECRET"})
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "peer_secret_file" in out.stderr, out.stderr
    assert not (tmp_path / "ram").exists()


def _serve(root, tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    """`cache serve` that must refuse at start (a daemon that starts instead fails the test by timeout)."""
    return subprocess.run([sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--ram-dir",
                           str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd"), "--socket", str(tmp_path / "c.sock"),
                           *args], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "LOONGFORGE_CACHE_PEER_SECRET"}, **(env or {})})


def test_inline_secret_in_a_config_others_may_read_is_refused(synthetic_root, tmp_path):
    """`peer_secret = "..."` in a 0644 cache.toml started the peer port on 0.0.0.0 without a word, while
    a key file of the same mode is refused. The config file holding a secret is now held to the key
    file's rule: one line at start, nothing created; at 0600 it is accepted."""
    root, _ = synthetic_root
    conf = tmp_path / "cache.toml"
    conf.write_text(f'[cache]\npeer_listen = "0.0.0.0:0"\npeer_secret = "{KEY}"\n')
    os.chmod(conf, 0o644)
    out = _serve(root, tmp_path, "--config", str(conf))
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"config file {conf}" in out.stderr and "holds peer_secret" in out.stderr, out.stderr
    assert not (tmp_path / "ram").exists()
    os.chmod(conf, 0o640)  # the daemon's group is every trainer
    with pytest.raises(ConfigError, match="holds peer_secret"):
        load_config(str(conf), env={}, origin=root)
    os.chmod(conf, 0o600)
    assert load_secret(load_config(str(conf), env={}, origin=root)) == KEY.encode()
    conf.write_text('[cache]\nredis_password = "hunter2"\n')
    os.chmod(conf, 0o644)
    with pytest.raises(ConfigError, match="holds redis_password"):
        load_config(str(conf), env={}, origin=root)


def test_secret_with_too_little_entropy_is_refused(synthetic_root, tmp_path):
    """A secret of 32 x `a` was accepted (only its length was checked)."""
    root, _ = synthetic_root
    out = _serve(root, tmp_path, "--peer-listen", "127.0.0.1:0", env={"LOONGFORGE_CACHE_PEER_SECRET": "a" * 32})
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "bits of entropy" in out.stderr, out.stderr
    assert "openssl rand -hex 32" in out.stderr and not (tmp_path / "ram").exists()
    for weak in ("0123456789abcdef" * 4, "password" * 4, "a" * 63 + "b"):
        with pytest.raises(ConfigError, match="bits of entropy"):
            load_secret(CacheConfig(origin=root, peer_listen="127.0.0.1:0", peer_secret=weak))
    for strong in (KEY, secrets.token_hex(16), PEER_SECRET):
        assert load_secret(CacheConfig(origin=root, peer_listen="127.0.0.1:0", peer_secret=strong))


def test_shipped_config_requires_the_secret_and_binds_no_wildcard():
    """infra/cache/cache.toml shipped the peer port (every shard, to any signed request) and the
    unauthenticated metrics port on 0.0.0.0. Now both are loopback, each says what it exposes, the
    DaemonSet names the pod's own address, and the peer port still needs the key file (0600 / 0400)."""
    cfg = load_config(os.path.join(INFRA, "cache.toml"), env={})
    assert parse_hostport(cfg.peer_listen, "peer_listen")[0] == "127.0.0.1" and cfg.metrics_host == "127.0.0.1"
    assert cfg.peer_secret_file == "/etc/loongforge/peer.key"
    with open(os.path.join(INFRA, "cache.toml")) as f:
        toml = f.read()
    assert "NO authentication" in toml and "never shard bytes" in toml and "serves every shard" in toml
    assert all("never 0.0.0.0" in line for line in toml.splitlines() if "0.0.0.0" in line)
    with open(os.path.join(INFRA, "daemonset.yaml")) as f:
        daemonset = f.read()
    assert "name: loongforge-cache-peer" in daemonset and "path: peer.key, mode: 0400" in daemonset
    assert '"--peer-listen", "$(POD_IP):7712"' in daemonset and "0.0.0.0" not in daemonset
    assert "name: LOONGFORGE_CACHE_METRICS_HOST" in daemonset
    with open(os.path.join(INFRA, "loongforge-cache.service")) as f:
        assert "install -o loongforge -m 600 peer.key /etc/loongforge/" in f.read()
