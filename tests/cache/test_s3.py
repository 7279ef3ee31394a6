"""The cache daemon in front of an S3 origin (moto's real S3 endpoint, reached
through s3fs with only the standard AWS_* environment)."""

from __future__ import annotations

import os

import fsspec
import pytest
from tests.cache.cache_helpers import counter, settled

from loongforge.shared.errors import IntegrityError

pytestmark = pytest.mark.slow


def _local(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def test_daemon_fills_from_s3_and_serves_from_its_tiers(s3_server, synthetic_root, daemons):
    root, index = synthetic_root
    url = s3_server.upload(root, s3_server.bucket("cache-origin") + "/shards")
    names = [s.name for s in index.shards]
    d = daemons(url, index)  # the daemon reads index.json from S3 too
    with d.client() as c:
        for _ in range(2):  # second pass: RAM/SSD hits, no more S3 reads
            for n in names:
                assert bytes(c.read_shard(n)) == _local(root, n) and not c.degraded
    st = settled(d)
    assert counter(st, "fills", "origin") == len(names)
    assert st["tiers"]["ssd"]["shards"] == len(names)


def test_s3_object_corrupted_at_origin_is_refused_not_cached(s3_server, synthetic_root, daemons):
    root, index = synthetic_root
    url = s3_server.upload(root, s3_server.bucket("cache-corrupt") + "/shards")
    victim = index.shards[2].name
    data = bytearray(_local(root, victim))
    data[-700] ^= 0x01
    fsspec.filesystem("s3").pipe(f"{url}/{victim}", bytes(data))
    d = daemons(url, index)
    with pytest.raises(IntegrityError, match="sha256"):  # the daemon's error crosses the socket typed
        d.request("get", shard=victim)
    st = d.stats()
    assert counter(st, "corrupt", "origin") == 1
    assert st["tiers"]["ram"]["shards"] == st["tiers"]["ssd"]["shards"] == 0
