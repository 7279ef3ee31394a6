"""The trainer's loader on an s3:// shard root (moto's real S3 endpoint),
decode workers included: they read byte ranges from S3 in their own processes."""

from __future__ import annotations

import pytest
import torch

from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.samples import DeltaSpec


@pytest.mark.slow
def test_loader_on_s3_root_gives_the_local_batches(s3_server, train_root):
    root, _ = train_root
    url = s3_server.upload(root, s3_server.bucket("train-data") + "/shards")
    batches = []
    for data, workers in ((root, 0), (url, 2)):
        with BlockLoader(data, batch_size=4, num_workers=workers, seed=5, rank=0, world=2, max_steps=6,
                         deltas=DeltaSpec(video=(-1, 0), action_horizon=4)) as loader:  # the S3 run opens it on S3
            batches.append([(b["sample_ids"].clone(), b["frames"]["front"].clone(), b["action"].clone())
                            for b in loader])
    local, remote = batches
    assert len(local) == len(remote) == 6
    for (ids_a, front_a, act_a), (ids_b, front_b, act_b) in zip(local, remote):
        assert torch.equal(ids_a, ids_b) and torch.equal(front_a, front_b) and torch.equal(act_a, act_b)
