"""The Beam job reading a LeRobot dataset from S3 and writing shards to S3
(moto's real S3 endpoint through s3fs, as a Dataflow job with s3:// paths), in the default
format (2); shared/test_s3.py reads format-1 roots over S3."""

from __future__ import annotations

from pathlib import Path

import fsspec

from loongforge.shared.dataset import open_root, read_manifest

PARAMS = dict(block_frames=4, action_horizon=6, shard_size=1 << 16, fingerprint="content")


def test_s3_in_s3_out_equals_the_local_run(s3_server, sample_dataset, tmp_path, run_in_memory):
    bucket = s3_server.bucket("preprocess-io")
    src = s3_server.upload(sample_dataset, bucket + "/lerobot/sample")
    out = bucket + "/shards/run"
    summary = run_in_memory(src, out, **PARAMS)
    local = str(tmp_path / "local")
    run_in_memory(sample_dataset, local, **PARAMS)

    assert summary["failed"] == 0 and summary["samples"] > 0
    remote, here = read_manifest(out), read_manifest(local)
    # Byte-identical shards and tables whichever storage the job read and wrote.
    assert len(remote["shards"]) > 1 and remote["shards"] == here["shards"] and remote["tables"] == here["tables"]
    assert remote["dataset"]["source"]["uri"] == src
    assert remote["dataset"]["source"]["fingerprint"] == here["dataset"]["source"]["fingerprint"]  # not location
    fs = fsspec.filesystem("s3")
    written = sorted(p.removeprefix(out.removeprefix("s3://") + "/") for p in fs.find(out))
    expected = sorted(str(p.relative_to(local)) for p in Path(local).rglob("*") if p.is_file())
    assert written == expected  # the same files, and no staging or temp debris in the bucket
    ds = open_root(out)
    assert ds.verify() == []
    assert ds.num_frames == open_root(local).num_frames == summary["samples"]
