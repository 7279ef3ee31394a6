"""The cache daemon serves a shard root unchanged, per shard: a real daemon process over a
root, and open_root reading every block through its client."""

from __future__ import annotations

import numpy as np
import pytest

from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.synthetic import make_synthetic_root

from tests.cache.cache_helpers import counter, settled

pytestmark = pytest.mark.slow


def test_daemon_serves_shards_to_open_root(tmp_path, daemons):
    root = str(tmp_path / "root")
    written = make_synthetic_root(root, lengths=(30, 12, 25), block_size=8, shard_size=1 << 15)
    index = load_shard_index(root)
    d = daemons(root, index, ram="4MiB", ssd="8MiB")
    client = d.client()
    ds = open_root(root, source=client)
    assert ds.source is client
    for e in range(ds.num_episodes):
        frames, arrays = written[ds.episode_id(e)]
        for cam in ds.cameras:
            got = np.concatenate([ds.read_block(e, cam, b) for b in range(ds.num_blocks(e))])
            np.testing.assert_array_equal(got, frames[cam])
        np.testing.assert_array_equal(ds.read_arrays(e)["state"], arrays["state"])
    st = settled(d)
    assert counter(st, "fills", "origin") == len(index.shards) > 1  # every shard came through the daemon once
    client.close()
