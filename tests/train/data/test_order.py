"""Block-aware global order (train/data/order.py): deterministic, every sample once per epoch,
rank-balanced and disjoint, runs of a block on one rank, the tail dropped and counted."""

import numpy as np
import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.data import order
from loongforge.train.data.order import EpochOrder, batch_diversity, block_sequence, rank_slice
from loongforge.train.data.samples import SampleTable


def _table(seed=0, episodes=40):
    lengths = np.random.default_rng(seed).integers(1, 90, episodes)
    return SampleTable(lengths)


@pytest.mark.parametrize("run,window,world,per_rank", [(1, 1, 1, 8), (4, 256, 4, 6), (16, 10**9, 8, 4),
                                                       (3, 50, 2, 5)])
def test_every_sample_exactly_once_per_epoch_across_ranks(run, window, world, per_rank):
    table = _table()
    groups = table.block_groups(16)
    g = world * per_rank
    for epoch in (0, 1):
        seq = block_sequence(groups, 7, epoch, run=run, window=window)
        assert np.array_equal(np.sort(seq), np.arange(table.num_samples))  # a permutation: none twice, none missing
        plan = order.plan_epoch(len(seq), g)
        seen = [rank_slice(seq, c, g, r, world) for c in range(0, plan.steps * g, g) for r in range(world)]
        assert {len(s) for s in seen} == {per_rank}  # rank-balanced
        flat = np.concatenate(seen)
        assert len(np.unique(flat)) == len(flat) == plan.steps * g  # disjoint across ranks and steps
        assert len(seq) - len(flat) == plan.dropped < g


def test_deterministic_and_differs_by_epoch_and_seed():
    groups = _table().block_groups(8)
    a = block_sequence(groups, 1, 0, run=4, window=64)
    assert np.array_equal(a, block_sequence(groups, 1, 0, run=4, window=64))
    assert not np.array_equal(a, block_sequence(groups, 1, 1, run=4, window=64))
    assert not np.array_equal(a, block_sequence(groups, 2, 0, run=4, window=64))


def test_runs_are_contiguous_samples_of_one_block_on_one_rank():
    table = _table(3)
    groups = table.block_groups(16)
    seq = block_sequence(groups, 0, 0, run=4, window=512)
    # Every sample sits in a run of <= 4 samples of one group; runs of a full group have exactly 4.
    changes = np.flatnonzero(groups[seq][1:] != groups[seq][:-1]) + 1
    lengths = np.diff(np.r_[0, changes, len(seq)])
    assert lengths.max() <= 4 * 2  # two runs of one group may happen to be adjacent
    assert np.mean(lengths >= 4) > 0.5
    # A rank's micro batch is a contiguous slice (G/world = 8), so it holds about 8/4 runs; a strided
    # slicing (position p to rank p % world) would give it 8 samples of 8 different runs.
    ours = [len(np.unique(groups[rank_slice(seq, c, 64, r, 8)])) for c in range(0, 640, 64) for r in range(8)]
    strided = [len(np.unique(groups[seq[c + np.arange(r, 64, 8)]])) for c in range(0, 640, 64) for r in range(8)]
    assert np.mean(ours) <= 3.5 and np.mean(strided) >= 6


def test_window_bounds_how_far_a_group_spreads():
    groups = _table(5).block_groups(16)
    window = 128
    seq = block_sequence(groups, 0, 0, run=2, window=window)
    pos = np.empty_like(seq)
    pos[seq] = np.arange(len(seq))
    for gno in np.unique(groups)[:50]:
        p = pos[groups == gno]
        assert p.max() - p.min() < 2 * window + 16


def test_run_1_and_huge_window_is_as_diverse_as_a_random_permutation():
    table = _table(1, episodes=200)
    groups = table.block_groups(16)
    ep, t = table.locate(np.arange(table.num_samples))
    rand = np.random.default_rng(0).permutation(table.num_samples)
    ours = block_sequence(groups, 0, 0, run=1, window=10**9)
    d_rand, d_ours = (batch_diversity(s, ep, t, groups, 64) for s in (rand, ours))
    assert abs(d_ours["distinct_episodes"] - d_rand["distinct_episodes"]) < 0.05
    local = batch_diversity(block_sequence(groups, 0, 0, run=8, window=64), ep, t, groups, 64)
    assert local["distinct_blocks"] <= 9 / 64 + 1e-9 < d_rand["distinct_blocks"]  # a window of 64 = 8 runs


def test_keep_filters_and_stays_a_permutation_of_the_kept():
    table = _table(2)
    keep = table.keep_mask(np.arange(40) % 5 != 0)
    seq = block_sequence(table.block_groups(8), 0, 0, run=2, window=32, keep=keep)
    assert np.array_equal(np.sort(seq), np.flatnonzero(keep))


def test_bad_parameters():
    with pytest.raises(ConfigError):
        block_sequence(np.zeros(4, np.int64), 0, 0, run=0, window=4)
    seq = np.arange(16)
    with pytest.raises(ConfigError, match="divisible"):
        rank_slice(seq, 0, 6, 0, 4)
    with pytest.raises(ConfigError, match="divisible"):
        order.check_layout(5, 0, 2)
    with pytest.raises(ConfigError, match="0 <= rank < world"):
        order.check_layout(4, 2, 2)
    with pytest.raises(ConfigError, match="multiple of the global batch"):
        rank_slice(seq, 3, 4, 0, 1)
    with pytest.raises(IndexError):
        rank_slice(seq, 16, 8, 0, 2)
    with pytest.raises(ConfigError, match="lower --batch-size"):
        order.plan_epoch(7, 8)


def test_advance_rolls_over_and_drops_tail():
    plan = order.plan_epoch(10, 4)
    assert (plan.steps, plan.dropped) == (2, 2)
    state = (0, 0)
    seen = []
    for _ in range(5):
        seen.append(state)
        state = order.advance(*state, plan)
    assert seen == [(0, 0), (0, 4), (1, 0), (1, 4), (2, 0)]


def test_micro_batches_drop_the_tail_in_whole_optimizer_steps():
    """--grad-accum 2: the loader's batch (4) is half the step's (8); an epoch of 52 samples reads the 48
    one rank of batch 8 reads, in 12 micro-batches, then rolls over where that run does."""
    whole, micro = order.plan_epoch(52, 8), order.plan_epoch(52, 4, step_batch=8)
    assert (whole.steps, whole.dropped) == (6, 4) and (micro.steps, micro.dropped) == (12, 4)
    assert order.plan_epoch(52, 4).steps == 13  # without the step's batch: one micro-batch into the tail
    state, seen = (0, 0), []
    for _ in range(13):
        seen.append(state)
        state = order.advance(*state, micro)
    assert seen[-2:] == [(0, 44), (1, 0)]
    with pytest.raises(ConfigError, match="not a multiple"):
        order.plan_epoch(52, 3, step_batch=8)
    with pytest.raises(ConfigError, match="16 exceeds the 12 samples"):
        order.plan_epoch(12, 8, step_batch=16)


def test_a_kept_tail_is_one_more_smaller_batch_split_over_the_ranks():
    plan = order.plan_epoch(10, 4, drop_last=False)
    assert (plan.steps, plan.dropped) == (3, 0)
    state, seen = (0, 0), []
    for _ in range(4):
        seen.append(state)
        state = order.advance(*state, plan)
    assert seen == [(0, 0), (0, 4), (0, 8), (1, 0)]
    seq = np.arange(10)[::-1]
    parts = [rank_slice(seq, c, 4, r, 2, tail=True) for c in (0, 4, 8) for r in range(2)]
    assert [len(p) for p in parts] == [2, 2, 2, 2, 1, 1]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))  # every sample once, none repeated
    assert order.plan_epoch(3, 4, drop_last=False).steps == 1  # fewer samples than one batch: one short batch
    with pytest.raises(IndexError):
        rank_slice(seq, 8, 4, 0, 2)  # without tail=True the tail is not a batch


def test_world_change_keeps_global_sequence():
    """The state is one global counter: the rank slices of a step, laid side by side, are the step
    of one rank, so a resume may change the data-parallel degree."""
    lazy = EpochOrder(_table(6), 8, 1, 0, run=2, window=24)
    g = 8
    for consumed in range(0, 10 * g, g):
        two = np.concatenate([lazy.rank_ids(consumed, g, r, 2) for r in range(2)])
        assert np.array_equal(two, lazy.rank_ids(consumed, g, 0, 1))


def _cases():
    """Small datasets over the knobs the order depends on: stride (incl. > B: blocks without a
    sample), B, run (incl. > window: windows without a run), window, a split, empty episodes."""
    for case in range(60):
        r = np.random.default_rng(case)
        lengths = r.integers(0 if case % 3 == 0 else 1, r.integers(2, 120), r.integers(1, 40))
        stride, block = int(r.choice([1, 1, 2, 3, 20])), int(r.choice([1, 4, 8, 16]))
        run, window = int(r.choice([1, 2, 3, 4, 16, 40])), int(r.choice([1, 7, 64, 200, 10**9]))
        table = SampleTable(lengths, stride=stride)
        train = None if case % 2 else np.arange(len(lengths)) % 4 != 1
        if table.num_samples and (train is None or table.counts[train].sum()):
            yield case, table, block, run, window, train


def test_epoch_order_is_block_sequence_position_for_position():
    """The lazy order must give the sequence block_sequence gives (so checkpoints resume exactly)."""
    for case, table, block, run, window, train in _cases():
        full = block_sequence(table.block_groups(block), case, case % 3, run=run, window=window,
                              keep=table.keep_mask(train))
        lazy = EpochOrder(table, block, case, case % 3, run=run, window=window, train_episodes=train)
        assert lazy.num_samples == len(full)
        assert np.array_equal(lazy.ids(0, len(full)), full), case
        r = np.random.default_rng(case)
        for a in r.integers(0, len(full), 6):  # any stretch, in any order of asking
            b = int(r.integers(a, len(full) + 1))
            assert np.array_equal(lazy.ids(int(a), b), full[a:b]), (case, a, b)


def test_rank_ids_and_episodes_match_the_full_rank_slices():
    table = _table(4, episodes=60)
    full = block_sequence(table.block_groups(16), 3, 1, run=4, window=96)
    lazy = EpochOrder(table, 16, 3, 1, run=4, window=96)
    g, world = 48, 4
    end = order.plan_epoch(len(full), g).steps * g
    ep_of = table.locate(np.arange(table.num_samples))[0]
    for rank in range(world):
        for c in range(0, end, g):
            assert np.array_equal(lazy.rank_ids(c, g, rank, world), rank_slice(full, c, g, rank, world))
        mine = np.concatenate([rank_slice(full, c, g, rank, world) for c in range(g, end, g)])
        got = np.concatenate(list(lazy.rank_episodes(g, end, g, rank, world)))
        want = ep_of[mine]
        _, i = np.unique(want, return_index=True)
        _, j = np.unique(got, return_index=True)
        assert np.array_equal(want[np.sort(i)], got[np.sort(j)])  # the same episodes, first seen in the same order
    with pytest.raises(ConfigError):
        lazy.rank_ids(5, g, 0, world)
    with pytest.raises(IndexError):
        lazy.rank_ids(end, g, 0, world) if end + g > len(full) else lazy.ids(0, len(full) + 1)


def test_epoch_order_memory_is_per_group_not_per_sample():
    """block_sequence holds several int64 arrays per sample on every rank (~90 B a sample at
    peak); the lazy order holds a few numbers per group of B samples plus one window."""
    import tracemalloc

    table = SampleTable(np.full(4000, 500))  # 2 M samples, 125 k groups of 16
    tracemalloc.start()
    try:
        lazy = EpochOrder(table, 16, 0, 0, run=4, window=65536)
        ids = lazy.rank_ids(1024 * 100, 1024, 3, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(np.unique(ids)) == 128
    assert peak < 8 * table.num_samples, f"{peak / table.num_samples:.1f} bytes per sample"
