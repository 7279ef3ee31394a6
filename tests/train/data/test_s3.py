"""The trainer's loader on an s3:// shard root (moto's real S3 endpoint),
decode workers included: they read byte ranges from S3 in their own processes."""

from __future__ import annotations

import pytest
import torch

from loongforge.train.data.loader_v1 import ShardLoader


@pytest.mark.slow
def test_loader_on_s3_root_gives_the_local_batches(s3_server, train_root):
    root, index = train_root
    url = s3_server.upload(root, s3_server.bucket("train-data") + "/shards")
    batches = []
    for data, workers in ((root, 0), (url, 2)):
        with ShardLoader(data, batch_size=4, num_workers=workers, seed=5, rank=0, world=2,
                         max_steps=6) as loader:  # no index passed: the S3 run loads index.json from S3
            batches.append([(b["sample_ids"].clone(), b["frames"]["front"].clone(), b["action"].clone())
                            for b in loader])
    local, remote = batches
    assert len(local) == len(remote) == 6
    for (ids_a, front_a, act_a), (ids_b, front_b, act_b) in zip(local, remote):
        assert torch.equal(ids_a, ids_b) and torch.equal(front_a, front_b) and torch.equal(act_a, act_b)
