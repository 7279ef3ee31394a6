"""One node: a real daemon process, real tier files, real client mmaps."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from loongforge.cache.client import CacheClient
from loongforge.cache.protocol import Connection
from loongforge.shared.errors import CacheUnavailableError, IntegrityError, ShardNotFoundError, UnsafePathError

from tests.cache.cache_helpers import counter, settled, wait_for
from tests.conftest import free_port

pytestmark = pytest.mark.slow
SHARD = 50 * 1024  # synthetic_root shards are ~49 KiB; budgets below are multiples of this


def _origin_bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def _tier_files(directory):
    data = os.path.join(directory, "data")
    return sorted(os.path.relpath(os.path.join(d, f), data) for d, _, fs in os.walk(data) for f in fs)


def test_hit_miss_eviction_accounting_and_metrics(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    port = free_port()
    d = daemons(root, index, ram=str(int(2.2 * SHARD)), extra=("--metrics-port", str(port)))
    conn = Connection(d.socket, None, 10.0)
    tiers = []
    for name in (s[0], s[1], s[2], s[1], s[0]):  # no plan announced: LRU
        tiers.append(conn.request("get", shard=name)["tier"])
        conn.request("release", shard=name)
    st = settled(d)
    assert tiers == ["ram"] * 5
    assert counter(st, "misses", "ram") == 4 and counter(st, "hits", "ram") == 1
    assert counter(st, "misses", "ssd") == 3 and counter(st, "hits", "ssd") == 1
    assert counter(st, "fills", "origin") == 3 and counter(st, "fills", "ssd") == 1
    assert counter(st, "evictions", "ram") == 2  # s0 (LRU) for s2, then s2 for s0
    assert counter(st, "bytes_served", "ram") == sum(index.shard(n).bytes for n in (s[0], s[1], s[2], s[1], s[0]))
    assert _tier_files(d.ram_dir) == sorted([s[0], s[1]])
    assert _tier_files(d.ssd_dir) == sorted(s[:3])  # write-through: SSD keeps what RAM dropped
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loongforge_cache_hits_total{tier="ram"} 1.0' in metrics
    assert 'loongforge_cache_fills_total{source="origin"} 3.0' in metrics
    conn.close()

    with d.client() as client:  # the client hands out an mmap of the RAM tier file
        view = client.read_shard(s[1])
        assert bytes(view) == _origin_bytes(root, s[1])
        assert bytes(client.read_range(s[1], 100, 50)) == _origin_bytes(root, s[1])[100:150]
        assert not client.degraded and client.counts["origin_reads"] == 0


def test_pinned_shards_are_never_evicted(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, ram=str(int(2.2 * SHARD)))
    reader = Connection(d.socket, None, 10.0)
    assert reader.request("get", shard=s[0])["tier"] == "ram"
    assert reader.request("get", shard=s[1])["tier"] == "ram"
    other = Connection(d.socket, None, 10.0)
    reply = other.request("get", shard=s[2])  # RAM holds two pinned shards: s2 is served from SSD
    assert reply["tier"] == "ssd" and os.path.exists(reply["path"])
    assert _tier_files(d.ram_dir) == sorted(s[:2])
    reader.request("release", shard=s[0])
    assert other.request("get", shard=s[3])["tier"] == "ram"
    assert _tier_files(d.ram_dir) == sorted([s[1], s[3]])  # the released one went, the pinned one stayed
    reader.close()  # a closed connection drops its pins
    wait_for(lambda: d.stats()["pinned"] == 2, what="the closed connection's pin on s1 to go")
    assert other.request("get", shard=s[0])["tier"] == "ram"
    other.close()


def test_ssd_budget_exceeded_evicts(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, ram=str(int(1.2 * SHARD)), ssd=str(int(2.2 * SHARD)))
    with d.client(max_open=1) as client:
        for name in s:
            assert bytes(client.read_shard(name)) == _origin_bytes(root, name)
    st = settled(d)
    assert counter(st, "evictions", "ssd") == 2
    assert st["tiers"]["ssd"]["used"] <= st["tiers"]["ssd"]["budget"]
    assert len(_tier_files(d.ssd_dir)) == 2 and len(_tier_files(d.ram_dir)) == 1


def test_restart_reverifies_ssd_and_refetches_corrupt(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, extra=("--ssd-verify", "full"))
    with d.client() as client:
        for name in s:
            client.read_shard(name)
    assert d.stop() == 0  # SIGTERM: clean shutdown
    assert not os.path.exists(d.socket) and _tier_files(d.ram_dir) == []
    assert _tier_files(d.ssd_dir) == sorted(s)  # SSD survives the restart
    with open(os.path.join(d.ssd_dir, "data", s[0]), "r+b") as f:  # bit rot
        f.seek(700)
        byte = f.read(1)
        f.seek(700)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(os.path.join(d.ssd_dir, "data", s[1]), 1000)  # torn write
    d.start()
    st = d.stats()
    assert counter(st, "corrupt", "ssd") == 2 and st["tiers"]["ssd"]["shards"] == 2
    # Corruption after the start-up check is caught when the entry is promoted to RAM.
    with open(os.path.join(d.ssd_dir, "data", s[3]), "r+b") as f:
        f.seek(10)
        f.write(b"XXXX")
    with d.client() as client:
        for name in s:
            assert bytes(client.read_shard(name)) == _origin_bytes(root, name)
    st = d.stats()
    assert counter(st, "corrupt", "ssd") == 3
    assert counter(st, "fills", "origin") == 3 and counter(st, "hits", "ssd") == 1  # only s2 was intact


def test_bad_names_and_messages_rejected(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index)
    conn = Connection(d.socket, None, 10.0)
    for name in ("../../etc/passwd", "/etc/passwd", "shards/../index.json", "shards/./shard-000000.tar"):
        with pytest.raises(UnsafePathError):
            conn.request("get", shard=name)
    with pytest.raises(ShardNotFoundError):
        conn.request("get", shard="shards/shard-999999.tar")
    with pytest.raises(UnsafePathError):
        conn.request("announce", shards=["shards/shard-000000.tar", "../x"], rank=0, epoch=0)
    conn.sock.sendall(b"{not json\n")
    assert b'"ProtocolError"' in conn.rfile.readline()
    conn.sock.sendall(b'{"v":1,"id":7,"op":"rm -rf"}\n')
    assert b"unknown op" in conn.rfile.readline()
    st = d.stats()
    assert counter(st, "rejected", "unsafe_path") == 5 and counter(st, "rejected", "not_in_index") == 1
    assert not any(f.endswith("passwd") for f in _tier_files(d.ram_dir) + _tier_files(d.ssd_dir))
    with d.client() as client, pytest.raises(UnsafePathError):
        client.read_shard("../index.json")  # rejected before it leaves the process, fallback or not
    conn.close()


def test_daemon_killed_or_hung_client_falls_back_to_origin(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index)
    client = d.client(timeout=1.0)
    client.read_shard(s[0])
    assert not client.degraded
    d.proc.send_signal(signal.SIGSTOP)  # hung daemon: the client must not wait past its timeout
    wait_for(lambda: open(f"/proc/{d.proc.pid}/stat").read().split(") ")[1][0] == "T", what="SIGSTOP to land")
    t0 = time.monotonic()
    assert bytes(client.read_shard(s[1])) == _origin_bytes(root, s[1])
    assert time.monotonic() - t0 < 3.0 and client.degraded
    d.proc.send_signal(signal.SIGCONT)
    d.stop(signal.SIGKILL)  # dead daemon
    client.announce(s, rank=0, epoch=0)  # never raises with fallback
    assert bytes(client.read_shard(s[2])) == _origin_bytes(root, s[2]) and client.degraded
    assert client.counts["origin_reads"] == 2
    strict = d.client(fallback=False, timeout=1.0)
    with pytest.raises(CacheUnavailableError):
        strict.read_shard(s[3])
    client.close()
    strict.close()


def test_prefetch_follows_announced_plan(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    plan = [s[2], s[0], s[3], s[1]]
    d = daemons(root, index, extra=("--prefetch-window", "2"))
    with d.client() as client:
        client.announce(plan, rank=0, epoch=0)
        wait_for(lambda: counter(d.stats(), "prefetches", "ram") >= 2, what="prefetch of the first 2 shards")
        st = d.stats()
        assert set(_tier_files(d.ram_dir)) == {s[2], s[0]}  # exactly the window, nothing beyond it
        for i, name in enumerate(plan):
            wait_for(lambda: counter(d.stats(), "prefetches", "ram") >= min(4, i + 2), what="prefetch ahead")
            assert bytes(client.read_shard(name)) == _origin_bytes(root, name)
    st = d.stats()
    assert counter(st, "hits", "ram") == 4 and counter(st, "misses", "ram") == 0
    assert st["counters"]["prefetch_lead_s"]["count"] == 4


def test_cli_stats_and_stop(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index)
    with d.client() as client:
        client.read_shard(index.shards[0].name)
    cmd = [sys.executable, "-m", "loongforge.cache"]
    out = subprocess.run(cmd + ["stats", "--socket", d.socket, "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["counters"]["fills"]["origin"] == 1
    table = subprocess.run(cmd + ["stats", "--socket", d.socket], capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and "ram" in table.stdout and "fills: origin 1" in table.stdout
    stop = subprocess.run(cmd + ["stop", "--socket", d.socket], capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0
    assert d.proc.wait(timeout=15) == 0
    assert not os.path.exists(d.socket) and _tier_files(d.ram_dir) == []
    gone = subprocess.run(cmd + ["stats", "--socket", d.socket], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1 and "unreachable" in gone.stderr


def test_budget_smaller_than_a_shard_fails_at_start(synthetic_root, tmp_path):
    root, _ = synthetic_root
    out = subprocess.run([sys.executable, "-m", "loongforge.cache", "serve", "--origin", root, "--socket",
                          str(tmp_path / "s.sock"), "--ram-dir", str(tmp_path / "ram"), "--ssd-dir",
                          str(tmp_path / "ssd"), "--ram-budget", "10KiB"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "ram_budget" in out.stderr and "--ram-budget" in out.stderr and not os.path.exists(tmp_path / "s.sock")


def test_concurrent_readers_share_one_fill(synthetic_root, daemons):
    root, index = synthetic_root
    name = index.shards[0].name
    d = daemons(root, index, env={"LOONGFORGE_CACHE_ORIGIN_DELAY_S": "0.3"})
    results = []

    def read():
        with d.client(timeout=5.0) as c:
            results.append(bytes(c.read_shard(name)) == _origin_bytes(root, name) and not c.degraded)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [True] * 4
    assert counter(d.stats(), "fills", "origin") == 1


def test_eviction_uses_the_announced_plan(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, ram=str(int(2.2 * SHARD)))  # prefetch off: eviction alone decides
    with d.client(max_open=1) as client:
        client.announce([s[0], s[1], s[2], s[0]], rank=0, epoch=0)
        for name in (s[0], s[1], s[2]):
            client.read_shard(name)
        assert _tier_files(d.ram_dir) == sorted([s[0], s[2]])  # LRU would have dropped s0; s1 is never read again
        client.read_shard(s[0])
    st = d.stats()
    assert counter(st, "hits", "ram") == 1 and counter(st, "evictions", "ram") == 1


def test_disk_full_evicts_and_keeps_serving(synthetic_root, daemons, tiny_disk):
    root, index = synthetic_root
    d = daemons(root, index, ssd="1MiB", extra=("--ssd-dir", str(tiny_disk / "ssd")))  # budget > free space
    with d.client() as client:
        for e in index.shards:
            assert bytes(client.read_shard(e.name)) == _origin_bytes(root, e.name)
    st = settled(d)
    assert counter(st, "enospc", "ssd") >= 1 and counter(st, "evictions", "ssd") >= 1
    assert counter(st, "hits", "ram") + counter(st, "misses", "ram") == 4 and st["tiers"]["ram"]["shards"] == 4
    assert "disk full (ENOSPC)" in d.log()


def _fill_disk(path) -> None:
    """Someone else's file takes every free byte of the disk."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_full_ssd_disk_runs_ram_only_with_one_warning(synthetic_root, daemons, tiny_disk):
    """An SSD tier whose disk is full of other data (nothing of ours to evict): one WARNING, the tier
    marked disabled in stats and /metrics, RAM keeps serving, and a re-check turns it back on once
    there is room again. It used to log an ERROR per fill and per spill, with no back-off."""
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    port = free_port()
    d = daemons(root, index, ram=str(int(2.2 * SHARD)), ssd="1MiB",
                extra=("--ssd-dir", str(tiny_disk / "ssd"), "--metrics-port", str(port)),
                env={"LOONGFORGE_CACHE_TIER_RECHECK_S": "0.5", "LOONGFORGE_CACHE_TIER_RECHECK_MAX_S": "1"})
    _fill_disk(tiny_disk / "ballast")
    t0 = time.monotonic()
    with d.client(max_open=1) as client:
        for _ in range(3):
            for name in s:
                for _ in range(2):  # a RAM miss (origin), then a RAM hit
                    assert bytes(client.read_shard(name)) == _origin_bytes(root, name)
                    client.release(name)
        st = settled(d)
    elapsed = time.monotonic() - t0
    assert st["tiers"]["ssd"]["disabled"] and "ENOSPC" in st["tiers"]["ssd"]["disabled_reason"]
    assert counter(st, "hits", "ram") == 12 and st["tiers"]["ssd"]["shards"] == 0
    assert 1 <= counter(st, "enospc", "ssd") <= 1 + elapsed / 0.5  # one write per re-check, not one per fill
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loongforge_cache_tier_disabled{tier="ssd"} 1.0' in metrics
    table = subprocess.run([sys.executable, "-m", "loongforge.cache", "stats", "--socket", d.socket],
                           capture_output=True, text=True, timeout=30).stdout
    assert "ssd tier takes no new shards: disk full (ENOSPC)" in table, table
    log = d.log()
    assert "Evicting one shard" not in log and " ERROR " not in log
    assert len([ln for ln in log.splitlines() if " WARNING " in ln and "disk full" in ln]) == 1, log

    os.unlink(tiny_disk / "ballast")
    with d.client(max_open=1) as client:
        def written_again():
            for name in s:
                client.read_shard(name)
                client.release(name)
            return not settled(d)["tiers"]["ssd"]["disabled"]
        wait_for(written_again, timeout=15, what="the re-check to find room on the SSD")
    st = settled(d)
    assert st["tiers"]["ssd"]["shards"] >= 1 and "writable again" in d.log()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loongforge_cache_tier_disabled{tier="ssd"} 0.0' in metrics


def test_loopback_tcp_endpoint(synthetic_root, daemons):
    root, index = synthetic_root
    tcp = f"127.0.0.1:{free_port()}"
    d = daemons(root, index, extra=("--tcp", tcp))
    assert f"ready on tcp:{tcp}" in d.log() and not os.path.exists(d.socket)
    with CacheClient(root, index, tcp=tcp) as client:
        name = index.shards[1].name
        assert bytes(client.read_shard(name)) == _origin_bytes(root, name) and not client.degraded
        assert client.stats()["daemon"]["counters"]["fills"]["origin"] == 1


def test_cache_package_never_imports_torch():
    code = ("import sys, loongforge.cache.daemon, loongforge.cache.client, loongforge.cache.cli, "
            "loongforge.cache.replay, loongforge.cache.peer; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_size_only_start_check_still_catches_bit_rot_on_fill(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index)  # default --ssd-verify size: fast start
    with d.client() as client:
        client.read_shard(s[0])
    settled(d)
    assert d.stop() == 0
    with open(os.path.join(d.ssd_dir, "data", s[0]), "r+b") as f:
        f.seek(900)
        f.write(b"rot")
    d.start()
    assert d.stats()["tiers"]["ssd"]["shards"] == 1  # same size: kept at start
    with d.client() as client:
        assert bytes(client.read_shard(s[0])) == _origin_bytes(root, s[0])
    st = d.stats()
    assert counter(st, "corrupt", "ssd") == 1 and counter(st, "fills", "origin") == 1


def test_two_daemons_cannot_share_a_tier(synthetic_root, daemons):
    root, index = synthetic_root
    a = daemons(root, index, "node-a")
    b = daemons(root, index, "node-b", start=False)
    b.args[b.args.index("--ram-dir") + 1] = a.ram_dir
    b.proc = subprocess.Popen(b.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = b.proc.communicate(timeout=30)
    b.proc = None
    assert "in use by another cache daemon" in out
    with a.client() as client:  # a's RAM tier was not wiped by b
        assert bytes(client.read_shard(s0 := index.shards[0].name)) == _origin_bytes(root, s0)


def test_corrupt_origin_is_a_clear_error_not_cached(synthetic_root, daemons):
    root, index = synthetic_root
    name = index.shards[2].name
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(600)
        f.write(b"\x00garbage\x00")
    d = daemons(root, index)
    with d.client() as client, pytest.raises(IntegrityError, match="sha256"):
        client.read_shard(name)  # fallback on: origin would fail the same check, so it is raised
    st = settled(d)
    assert counter(st, "corrupt", "origin") == 1 and st["tiers"]["ram"]["shards"] == 0
    assert st["tiers"]["ssd"]["shards"] == 0


def test_shard_not_found_message_is_not_quoted(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index)
    conn = Connection(d.socket, None, 10.0)
    with pytest.raises(ShardNotFoundError) as over_the_wire:
        conn.request("get", shard="shards/shard-999999.tar")
    conn.close()
    with d.client() as client, pytest.raises(ShardNotFoundError) as in_client:
        client.read_shard("shards/shard-999999.tar")
    for exc in (over_the_wire.value, in_client.value):
        assert str(exc).startswith("shard 'shards/shard-999999.tar' is not in the index"), str(exc)


def test_cli_stats_into_a_closed_pipe_is_quiet(synthetic_root, daemons):
    """`loongforge cache stats | head -1`: the reader leaves before the table is written."""
    root, index = synthetic_root
    d = daemons(root, index)
    for extra in ((), ("--json",)):
        proc = subprocess.Popen([sys.executable, "-m", "loongforge.cache", "stats", "--socket", d.socket, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # long before the interpreter is up: its print hits EPIPE
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=30) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_graceful_stop_removes_the_whole_ram_tier(synthetic_root, daemons):
    root, index = synthetic_root
    d = daemons(root, index)
    with d.client() as client:
        client.read_shard(index.shards[0].name)
    assert os.path.exists(os.path.join(d.ram_dir, "CACHE_FORMAT.json"))
    assert d.stop() == 0
    assert not os.path.exists(d.ram_dir)  # marker and .lock too, as the README promises
    assert os.path.exists(os.path.join(d.ssd_dir, "CACHE_FORMAT.json"))  # SSD kept
    d.start()  # and a restart recreates it
    assert os.path.exists(os.path.join(d.ram_dir, "CACHE_FORMAT.json"))


def test_tier_usage_is_counted_in_pages(synthetic_root, daemons):
    root, index = synthetic_root
    page = os.sysconf("SC_PAGE_SIZE")
    sizes = [e.bytes for e in index.shards[:2]]
    assert all(b % page for b in sizes)  # otherwise this test could not tell pages from bytes
    pages = [-(-b // page) * page for b in sizes]
    d = daemons(root, index, ram=str(sum(sizes)))  # fits the files' bytes, not their pages
    with d.client(max_open=1) as client:
        for e in index.shards[:2]:
            client.read_shard(e.name)
    st = settled(d)
    assert st["tiers"]["ram"]["used"] == pages[1] and st["tiers"]["ram"]["shards"] == 1  # the first was evicted
    assert st["tiers"]["ssd"]["used"] == sum(pages)
    assert st["tiers"]["ram"]["used"] <= st["tiers"]["ram"]["budget"]


def test_max_open_follows_the_ram_budget(synthetic_root, daemons):
    """A 2-shard RAM tier: a client that kept 16 maps pinned both slots and the third shard went to SSD."""
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, ram=str(int(2.2 * SHARD)))
    with d.client() as client:  # max_open left at its default (16)
        for name in s[:3]:
            assert bytes(client.read_shard(name)) == _origin_bytes(root, name)
        assert client.max_open == 1
    st = d.stats()
    assert counter(st, "bytes_served", "ssd") == 0 and counter(st, "bytes_served", "ram") > 0


def test_client_renews_leases_of_open_maps(synthetic_root, daemons):
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index, ram=str(int(2.2 * SHARD)), extra=("--lease-s", "1"))
    with d.client() as holder:
        view = holder.read_shard(s[0])
        time.sleep(2.5)  # over two leases: only renewal keeps s0 pinned
        assert d.stats()["pinned"] == 1
        other = Connection(d.socket, None, 10.0)
        for name in s[1:]:  # each of these would evict the LRU shard, s0, if it were not pinned
            other.request("get", shard=name)
            other.request("release", shard=name)
        other.close()
        assert s[0] in _tier_files(d.ram_dir) and bytes(view) == _origin_bytes(root, s[0])
    wait_for(lambda: d.stats()["pinned"] == 0, what="the closed client's pin to go")


def test_forked_worker_reads_while_the_parent_lock_was_held(synthetic_root, daemons):
    """The lease thread may hold the client's lock when a DataLoader forks: the child must not hang."""
    root, index = synthetic_root
    s = [e.name for e in index.shards]
    d = daemons(root, index)
    with d.client() as client:
        client.read_shard(s[0])  # lease thread running from here on
        held, done_forking = threading.Event(), threading.Event()

        def renewer_mid_request():  # another thread holds the lock, as the lease thread may
            with client._lock:
                held.set()
                done_forking.wait(10)

        threading.Thread(target=renewer_mid_request, daemon=True).start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:  # child: never return into pytest
            try:
                os._exit(0 if bytes(client.read_shard(s[1])) == _origin_bytes(root, s[1]) else 1)
            except BaseException:  # noqa: BLE001
                os._exit(2)
        done_forking.set()
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked reader hung on the inherited client lock")
        assert os.waitstatus_to_exitcode(done[1]) == 0
