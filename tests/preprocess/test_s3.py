"""The Beam job reading a LeRobot dataset from S3 and writing shards to S3
(moto's real S3 endpoint through s3fs, as a Dataflow job with s3:// paths)."""

from __future__ import annotations

from pathlib import Path

import fsspec

from loongforge.shared.index import load_index
from loongforge.shared.reader import ShardReader

PARAMS = dict(frames_per_sample=4, stride=3, action_horizon=6, shard_size=1 << 16, fingerprint="content")


def test_s3_in_s3_out_equals_the_local_run(s3_server, sample_dataset, tmp_path, run_in_memory):
    bucket = s3_server.bucket("preprocess-io")
    src = s3_server.upload(sample_dataset, bucket + "/lerobot/sample")
    out = bucket + "/shards/v1"
    summary = run_in_memory(src, out, **PARAMS)
    local = str(tmp_path / "local")
    run_in_memory(sample_dataset, local, **PARAMS)

    assert summary["failed"] == 0 and summary["samples"] > 0
    remote, here = load_index(out), load_index(local)
    # Byte-identical shards whichever storage the job read and wrote.
    assert [(s.name, s.sha256, s.bytes) for s in remote.shards] == [(s.name, s.sha256, s.bytes) for s in here.shards]
    assert remote.dataset.source["uri"] == src
    assert remote.dataset.source["fingerprint"] == here.dataset.source["fingerprint"]  # content mode: not location
    fs = fsspec.filesystem("s3")
    written = sorted(p.removeprefix(out.removeprefix("s3://") + "/") for p in fs.find(out))
    expected = sorted(str(p.relative_to(local)) for p in Path(local).rglob("*") if p.is_file())
    assert written == expected  # the same files, and no staging or temp debris in the bucket
    assert ShardReader(out).verify() == []
    assert len(ShardReader(out)) == here.num_samples == summary["samples"]
