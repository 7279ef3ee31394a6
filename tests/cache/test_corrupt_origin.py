"""A shard corrupt at the origin, served through a real cache daemon: the daemon refuses the whole shard (its
sha256 fails), and the client then reads that shard's blocks and episode arrays one by one from the origin, each
checked against its own xxh3. Only the samples whose bytes are corrupt reach the bad-sample policy; every other
sample of the shard arrives bit-exact, and no corrupt byte is ever delivered."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.errors import IntegrityError
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.sources import SourceSpec
from tests.train.data.test_integrity import flip_state_byte
from tests.train.data.test_loader import _flip_block_byte

pytestmark = pytest.mark.slow


def _pair(tmp_path, make):
    pristine, root = str(tmp_path / "pristine"), str(tmp_path / "root")
    make(pristine)
    shutil.copytree(pristine, root)
    return pristine, root


def _rows_equal(got: dict, want: dict, row: int) -> bool:
    def eq(a, b):
        if isinstance(a, dict):
            return all(eq(a[k], b[k]) for k in a)
        return torch.equal(a[row], b[row]) if isinstance(a, torch.Tensor) else True

    return all(eq(got[k], want[k]) for k in want)


def _clone(batch):
    return {k: _clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def test_corrupt_episode_arrays_cost_that_episode_only(tmp_path, daemons, caplog):
    pristine, root = _pair(tmp_path, lambda r: make_synthetic_root(r, lengths=(4, 4), block_size=4))
    flip_state_byte(root, 1)  # the tar stays well-formed: only a checksum can tell
    d = daemons(root, load_shard_index(root))
    kw = dict(batch_size=8, max_steps=1, num_workers=0, seed=1)
    with BlockLoader(pristine, **kw) as loader:
        want = next(iter(loader))
    with caplog.at_level(logging.WARNING), \
            BlockLoader(root, source=SourceSpec(root=root, cache_socket=d.socket), **kw) as loader:
        got = next(iter(loader))
        assert loader.bad_samples == 4  # episode 1's samples; before the per-range reads: 8, the whole shard
    assert "one by one from origin" in caplog.text and "xxh3" in caplog.text
    ids = got["sample_ids"].tolist()
    assert ids == want["sample_ids"].tolist() and sorted(ids) == list(range(8))
    for row, gid in enumerate(ids):
        if gid >= 4:
            assert not got["sample_valid"][row] and not got["frame_mask"][row].any()
        else:  # episode 0, in the same shard: bit-exact
            assert got["sample_valid"][row] and _rows_equal(got, want, row), gid
    assert np.isfinite(got["state"].numpy()).all()  # the corrupt +inf never reaches the batch


def test_corrupt_block_costs_the_samples_that_show_it_only(tmp_path, daemons):
    pristine, root = _pair(tmp_path, lambda r: make_synthetic_root(r, lengths=(8, 8), height=8, width=8,
                                                                        block_size=4))
    _flip_block_byte(root, 1, "wrist", 0)
    index = load_shard_index(root)
    assert len(index.shards) == 1  # both episodes in the corrupt shard: before, all 16 samples were lost
    d = daemons(root, index)
    client = d.client()
    ds, ref = open_root(root, source=client), open_root(pristine)
    for e in range(ds.num_episodes):  # every other block and the arrays of the shard: bit-exact via the client
        for cam in ds.cameras:
            for b in range(ds.num_blocks(e)):
                if (e, cam, b) == (1, "wrist", 0):
                    with pytest.raises(IntegrityError, match="xxh3"):
                        ds.read_block(e, cam, b)
                else:
                    np.testing.assert_array_equal(ds.read_block(e, cam, b), ref.read_block(e, cam, b))
        np.testing.assert_array_equal(ds.read_arrays(e)["state"], ref.read_arrays(e)["state"])
    assert client.counts["origin_range_reads"] > 0
    client.close()
    kw = dict(batch_size=4, max_steps=4, rgb=False)
    with BlockLoader(pristine, **kw) as loader:
        want = [_clone(b) for b in loader]
    with BlockLoader(root, source=SourceSpec(root=root, cache_socket=d.socket), **kw) as loader:
        got = [_clone(b) for b in loader]
        assert loader.bad_samples == 4  # before: 16, every sample of the shard
    for g, w in zip(got, want, strict=True):
        for row, gid in enumerate(g["sample_ids"].tolist()):
            if gid in (8, 9, 10, 11):  # episode 1, t < 4: block 0 of its wrist camera
                assert not g["sample_valid"][row] and not g["action_valid"][row].any()
            else:
                assert g["sample_valid"][row] and _rows_equal(g, w, row), gid
