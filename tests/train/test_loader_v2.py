"""BlockLoader over a format-2 dataset (train/loader_v2.py)."""

import numpy as np
import pytest
import torch

from loongforge.shared.errors import CheckpointError, DataWorkerError
from loongforge.train.loader_v2 import BlockLoader
from loongforge.train.samples_v2 import DeltaSpec
from tests.train.fake_v2 import open_fake, write_fake

LENGTHS = [9, 5, 12, 3, 7, 10]


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("v2fake"))
    write_fake(root, LENGTHS)
    return root


def _loader(root, **kw):
    kw.setdefault("batch_size", 4)
    return BlockLoader(root, opener=open_fake, rgb=False, **kw)


def _check_batch(batch, ds, spec):
    for row, gid in enumerate(batch["sample_ids"].tolist()):
        e, t = _locate(gid)
        n = LENGTHS[e]
        want = np.clip(t + np.asarray(spec.video), 0, n - 1)
        for c, slot in enumerate(("front", "wrist")):
            px = batch["frames"][slot][row][:, 0, :3].numpy()
            assert px[:, 0].tolist() == [e] * spec.frames and px[:, 1].tolist() == want.tolist()
            assert px[:, 2].tolist() == [c] * spec.frames
        rows = np.minimum(t + np.arange(spec.action_horizon), n - 1)
        assert batch["action"][row][:, 0].tolist() == (e * 1000 + rows).tolist()
        assert batch["action_valid"][row].tolist() == (t + np.arange(spec.action_horizon) < n).tolist()
        assert batch["state"][row][:, 0].tolist() == (e * 1000 + want).tolist()
        text = bytes(v for v in batch["task_tokens"][row].tolist() if v < 256).decode()
        assert text == ("pick", "place")[e % 2]
    assert batch["frame_mask"].all() and batch["sample_valid"].all()


def _locate(gid):
    ends = np.cumsum(LENGTHS)
    e = int(np.searchsorted(ends, gid, side="right"))
    return e, gid - (ends[e] - LENGTHS[e])


def test_batches_hold_the_gr00t_sample_semantics(fake_root):
    spec = DeltaSpec(video=(-3, 0), action_horizon=4)
    with _loader(fake_root, deltas=spec, max_steps=11) as loader:
        ids = []
        for batch in loader:
            assert batch["frames"]["front"].shape == (4, 2, 12, 8)
            _check_batch(batch, loader.ds, spec)
            ids += batch["sample_ids"].tolist()
    assert len(ids) == len(set(ids)) == 44  # one epoch (46 samples, tail of 2 dropped), each once


@pytest.mark.slow
def test_real_workers_match_inline_and_count_cache_hits(fake_root):
    spec = DeltaSpec(video=(0,), action_horizon=3)
    runs, counters = [], []
    for workers in (0, 2):
        with _loader(fake_root, deltas=spec, num_workers=workers, max_steps=10, rank=1, world=2,
                     block_run=2, block_window=16) as loader:
            runs.append([(b["sample_ids"].clone(), b["frames"]["front"].clone(), b["action"].clone())
                         for b in loader])
            counters.append(loader.cache_counters())
    for (ia, fa, aa), (ib, fb, ab) in zip(*runs):
        assert torch.equal(ia, ib) and torch.equal(fa, fb) and torch.equal(aa, ab)
    for c in counters:
        assert c["hits"] > 0 and c["misses"] > 0 and c["samples"] > 0


def test_corrupt_block_is_a_masked_counted_bad_sample(tmp_path):
    root = str(tmp_path)
    write_fake(root, [8, 8], corrupt=[(1, "wrist", 0)])
    with _loader(root, max_steps=4, batch_size=4) as loader:
        bad_rows = 0
        for batch in loader:
            for row, gid in enumerate(batch["sample_ids"].tolist()):
                if gid in (8, 9, 10, 11):  # episode 1, t < 4: block 0 of its wrist camera
                    assert not batch["sample_valid"][row] and not batch["action_valid"][row].any()
                    bad_rows += 1
                else:
                    assert batch["sample_valid"][row]
        assert loader.bad_samples == bad_rows == 4
    with _loader(root, max_steps=4, batch_size=4, bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match="xxh3"):
            list(loader)


def test_val_episodes_are_left_out(tmp_path):
    root = str(tmp_path)
    write_fake(root, [4, 4, 4], val=[1])
    with _loader(root, max_steps=2) as loader:
        ids = [i for b in loader for i in b["sample_ids"].tolist()]
    assert sorted(ids) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_resume_continues_the_exact_sequence_and_refuses_another_order(fake_root):
    kw = dict(seed=5, block_run=2, block_window=8)
    with _loader(fake_root, max_steps=16, **kw) as full:  # crosses the epoch (11 steps)
        want = [b["sample_ids"].tolist() for b in full]
    with _loader(fake_root, max_steps=6, **kw) as first:
        got = [b["sample_ids"].tolist() for b in first]
        state = first.state_dict()
    with _loader(fake_root, max_steps=16, **kw) as second:
        second.load_state_dict(state)
        got += [b["sample_ids"].tolist() for b in second]
    assert got == want
    with _loader(fake_root, seed=5, block_run=4, block_window=8) as other:
        with pytest.raises(CheckpointError, match="order"):
            other.load_state_dict(state)
