"""Shard roots in S3 (a real S3 endpoint: moto's server, reached through
s3fs/botocore exactly as AWS would be)."""

from __future__ import annotations

import fsspec
import pytest

from loongforge.shared import storage
from loongforge.shared.errors import IntegrityError
from loongforge.shared.index import load_index
from loongforge.shared.reader import ShardReader


def test_s3_root_reads_like_local_and_verifies(s3_server, synthetic_root):
    root, index = synthetic_root
    url = s3_server.upload(root, s3_server.bucket("shared-read") + "/dataset/v1")
    assert load_index(url).to_json() == index.to_json()
    remote, local = ShardReader(url), ShardReader(root)
    assert remote.verify() == []
    for n in (0, 7, index.num_samples - 1):  # random access: byte ranges, no full-object reads
        a, b = remote[n], local[n]
        assert a.key == b.key and (a.frames["front"] == b.frames["front"]).all()
        assert (a.state == b.state).all()
    assert [s.key for s in ShardReader(url, verify=True)] == [s.key for s in local]


def test_s3_object_altered_after_indexing_fails_verification(s3_server, synthetic_root):
    root, index = synthetic_root
    url = s3_server.upload(root, s3_server.bucket("shared-corrupt") + "/ds")
    shard = index.shards[1]
    data = bytearray(storage.read_bytes(f"{url}/{shard.name}"))
    data[600] ^= 0xFF
    fsspec.filesystem("s3").pipe(f"{url}/{shard.name}", bytes(data))
    bad = ShardReader(url).verify()
    assert len(bad) == 1 and bad[0].startswith(shard.name + ": ") and "sha256" in bad[0], bad
    with pytest.raises(IntegrityError):
        storage.verify(storage.read_bytes(f"{url}/{shard.name}"), shard.name, shard.bytes, shard.sha256)


def test_unreachable_s3_endpoint_is_a_clear_storage_error(tmp_path):
    """Own process: s3fs caches its client per process, and this one must see a dead endpoint."""
    import os
    import subprocess
    import sys

    from tests.conftest import S3Server, free_port

    env = {**os.environ, **S3Server.ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
           "AWS_MAX_ATTEMPTS": "1"}
    code = ("from loongforge.shared.errors import StorageError\n"
            "from loongforge.shared.index import load_index\n"
            "try:\n    load_index('s3://nowhere/shards')\n"
            "except StorageError as exc:\n    print('StorageError:', exc)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "StorageError: could not read s3://nowhere/shards/index.json" in run.stdout
    assert "AWS_" in run.stdout  # says what to check


def test_s3_v2_root_opens_and_reads_blocks(s3_server, tmp_path):
    """Format 2 from an object store: tables fetched once per process (no mmap remotely),
    blocks by byte range, checksums verified."""
    import numpy as np

    from loongforge.shared.dataset_v2 import open_v2
    from loongforge.shared.synthetic_v2 import make_synthetic_v2_root

    root = str(tmp_path / "v2")
    written = make_synthetic_v2_root(root, lengths=(10, 7), block_size=4)
    url = s3_server.upload(root, s3_server.bucket("shared-v2") + "/ds")
    ds = open_v2(url)
    assert ds.verify() == []
    for e in range(ds.num_episodes):
        frames, arrays = written[ds.episode_id(e)]
        got = np.concatenate([ds.read_block(e, "wrist", b) for b in range(ds.num_blocks(e))])
        assert (got == frames["wrist"]).all() and (ds.read_arrays(e)["state"] == arrays["state"]).all()
