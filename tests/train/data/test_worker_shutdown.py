"""A truncated shard read through a real cache daemon by real decode workers: the workers close cleanly at the
end (no `BufferError: cannot close exported pointers exist` from a slot view a kept error still holds), and the
skipped samples are one WARNING for the shard plus one summary line with the count, not one line per sample."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from loongforge.shared.dataset import load_shard_index
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.sources import SourceSpec
from tests.cache.cache_helpers import DaemonProc

pytestmark = pytest.mark.slow


def test_truncated_shard_through_the_cache_closes_workers_cleanly_with_one_summary(tmp_path, capfd, caplog):
    root = str(tmp_path / "root")
    make_synthetic_root(root, lengths=(8, 8), block_size=4, shard_size=1)
    index = load_shard_index(root)
    shard = os.path.join(root, index.shards[1].name)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 3)
    d = DaemonProc(tmp_path / "nodes", root, index).start()
    try:
        with caplog.at_level(logging.WARNING), BlockLoader(root, batch_size=8, max_steps=2, num_workers=1, seed=1,
                                                            source=SourceSpec(root=root, cache_socket=d.socket)) \
                as loader:
            for _ in loader:
                pass
            assert loader.bad_samples == 8
    finally:
        d.stop(signal.SIGKILL)
    err = capfd.readouterr().err
    assert "BufferError" not in err and "exported pointers" not in err, err[-3000:]
    per_sample = [r for r in caplog.records if "skipped bad sample" in r.getMessage()]
    summary = [r for r in caplog.records if "skipped 8 bad samples from" in r.getMessage()]
    assert len(per_sample) == 1 and len(summary) == 1, [r.getMessage() for r in caplog.records]
