"""The bench's cache-daemon runner: a real `loongforge cache serve`, ready or a
clear error, never a hang."""

from __future__ import annotations

import time

import pytest

from loongforge.benchmarks.harness.daemon import CacheDaemon
from loongforge.benchmarks.loader.fast_path import cache_counters, warm_cache
from loongforge.shared.errors import CacheUnavailableError


@pytest.mark.slow
def test_daemon_serves_warms_and_counts(synthetic_root, tmp_path):
    root, index = synthetic_root
    with CacheDaemon(root, tmp_path, ram_budget="64MiB") as daemon:
        assert daemon.alive()
        stats = warm_cache(root, index, daemon.socket)
        assert stats["client"]["daemon_reads"] == len(index.shards) and stats["client"]["origin_reads"] == 0
        counters = cache_counters(root, index, daemon.socket)
        assert sum(counters["fills"].values()) == len(index.shards)
        ram_dir = daemon.ram_dir
    assert not daemon.alive() and not ram_dir.exists()  # stopped and cleaned up


@pytest.mark.slow
def test_daemon_with_a_bad_origin_fails_fast_with_its_output(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailableError, match="did not get ready"):
        CacheDaemon(str(tmp_path / "no-such-root"), tmp_path).start()
    assert time.monotonic() - t0 < 60
