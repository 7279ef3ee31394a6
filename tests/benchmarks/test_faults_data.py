"""The fault suite's data (benchmarks/faults/data.py), checked against the real loader without a launch:
the global order its sample accounting uses is the order the loader really serves (2 ranks), and the
corrupt-shard fault's expected skips are exactly the samples a loader masks out of the corrupt copy."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from loongforge.benchmarks.faults import data as fd


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    work = tmp_path_factory.mktemp("faults-data")
    root = str(work / "data")
    fd.make_root(root)
    return work, root


def _rank_batches(root: str, steps: int, rank: int):
    """(ids, valid) of `steps` batches of one of 2 ranks, from the loader the trainer builds (its defaults)."""
    from itertools import islice

    from loongforge.train.config import DataConfig
    from loongforge.train.data.training_data import load_training_data, make_loader

    d = DataConfig(root=root, seed=1)  # the suite's --seed
    loader = make_loader(d, load_training_data(d), batch_size=8, rank=rank, world=2, device="cpu")
    with loader:
        return [(b["sample_ids"].tolist(), b["sample_valid"].tolist()) for b in islice(loader, steps)]


def test_expected_order_is_what_two_ranks_are_served(roots):
    """10 steps cross the epoch boundary (8 steps an epoch): every step's ids, both ranks together, are that step of
    `expected_order`."""
    _, root = roots
    want = fd.expected_order(root, 10, 8)
    r0, r1 = (_rank_batches(root, 10, r) for r in (0, 1))
    got = [sorted(a[0] + b[0]) for a, b in zip(r0, r1, strict=True)]
    assert got == want
    assert len({i for ids in want[:8] for i in ids}) == 64  # an epoch: each sample once


def test_corrupt_block_expected_skips_are_what_the_loader_masks(roots):
    """The byte flipped in a frame block of the copy: reading that copy directly (every read checked by xxh3),
    the loader masks exactly `show_ids` (the samples whose video frames lie in that block), across 10 steps."""
    work, root = roots
    setup = fd.prepare_corrupt_shard(Path(work), root, "cs2")
    info = setup.info
    assert 0 < len(info["show_ids"]) < len(info["shard_ids"])  # a block, not the shard
    bad, seen = set(), set()
    for rank in (0, 1):
        for ids, valid in _rank_batches(setup.root, 10, rank):
            seen.update(ids)
            bad.update(i for i, v in zip(ids, valid) if not v)
    assert bad == set(info["show_ids"]) & seen and bad, (bad, info)
    assert "block 1" in info["corrupt_where"] and "shard-000001" in info["corrupt_where"]


def test_annotate_corrupt_shard_fails_a_row_that_skipped_more_than_the_block(tmp_path):
    """The row holds only when the skipped ids are exactly the trained samples showing the block: a whole shard
    refused (every sample of it skipped) fails it."""
    from loongforge.benchmarks.faults.env import Setup

    show, shard = [15, 16], list(range(11, 22))
    rows = [{"step": 0, "sample_ids": [[11, 12, 13, 14], [15, 16, 17, 18]]},
            {"step": 1, "sample_ids": [[19, 20, 21, 0], [1, 2, 3, 4]]}]
    setup = Setup(str(tmp_path), info={"show_ids": show, "shard_ids": shard, "corrupt_where": "x"})

    def annotate(skipped):
        log = tmp_path / "run.log"
        log.write_text("".join(f"2026-12-01 04:00:0{i},000 WARNING x: skipped bad sample (data.bad_samples='skip'): "
                               f"sample {g} (episode 2, t 4): IntegrityError: xxh3\n" for i, g in enumerate(skipped)))
        run = SimpleNamespace(rows=lambda: rows, log=SimpleNamespace(name=str(log)))
        row = {"recovered": True, "t_inject": 0.0}
        fd.annotate_corrupt_shard(row, run, setup)
        return row

    ok = annotate([15, 16])
    assert ok["recovered"] and ok["expected_skipped_ids"] == [15, 16] and "other 9 trained" in ok["action"]
    assert not annotate(shard)["recovered"]
    assert not annotate([])["recovered"]
