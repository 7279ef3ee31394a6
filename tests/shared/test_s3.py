"""Shard roots in S3 (a real S3 endpoint: moto's server, reached through
s3fs/botocore exactly as AWS would be)."""

from __future__ import annotations

import fsspec
import pytest

import numpy as np

from loongforge.shared import storage
from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.errors import IntegrityError
from loongforge.shared.synthetic import make_synthetic_root


def test_s3_root_reads_like_local_and_verifies(s3_server, tmp_path):
    """From an object store: tables fetched once per process (no mmap remotely), blocks and arrays
    by byte range, checksums verified."""
    root = str(tmp_path / "root")
    written = make_synthetic_root(root, lengths=(10, 7), block_size=4, shard_size=1)
    url = s3_server.upload(root, s3_server.bucket("shared-read") + "/dataset")
    assert load_shard_index(url).to_json() == load_shard_index(root).to_json()
    ds = open_root(url)
    assert ds.verify() == []
    for e in range(ds.num_episodes):
        frames, arrays = written[ds.episode_id(e)]
        got = np.concatenate([ds.read_block(e, "wrist", b) for b in range(ds.num_blocks(e))])
        assert (got == frames["wrist"]).all() and (ds.read_arrays(e)["state"] == arrays["state"]).all()


def test_s3_object_altered_after_indexing_fails_verification(s3_server, synthetic_root):
    root, index = synthetic_root
    url = s3_server.upload(root, s3_server.bucket("shared-corrupt") + "/ds")
    shard = index.shards[1]
    data = bytearray(storage.read_bytes(f"{url}/{shard.name}"))
    data[600] ^= 0xFF
    fsspec.filesystem("s3").pipe(f"{url}/{shard.name}", bytes(data))
    bad = open_root(url).verify()
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
            "from loongforge.shared.dataset import open_root\n"
            "try:\n    open_root('s3://nowhere/shards')\n"
            "except StorageError as exc:\n    print('StorageError:', exc)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "StorageError: could not read s3://nowhere/shards/index.json" in run.stdout
    assert "AWS_" in run.stdout  # says what to check
