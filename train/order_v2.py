"""Global sample order for format v2: deterministic from (seed, epoch), block-aware.

v1 orders samples that each carry their own frames. In v2 a sample's frames live in a
zstd block of B consecutive frames shared by up to B/stride samples, so a decode worker
should decompress a block once and serve several samples from it. The order:

1. samples are grouped by (episode, block of t) (`SampleTable.block_groups`); inside a
   group they are shuffled, then cut into *runs* of `run` consecutive samples;
2. groups are permuted, their runs laid end to end, and the runs shuffled inside windows
   of `window` samples (a bounded shuffle buffer at run granularity): a group's runs stay
   within about one window, so a worker's block cache (block_cache.py) sees them again;
3. global batch b is positions [b*G, (b+1)*G); rank r takes the CONTIGUOUS slice
   [r*G/world, (r+1)*G/world) of it, so a run never straddles ranks (v1's strided
   p % world would scatter a run over ranks and every rank would decode the block).

`run` = 1 and `window` >= the epoch is a uniform random permutation (GR00T's sampler);
larger `run` trades batch diversity for decodes (measured by `batch_diversity`, reported
in benchmarks/README.md). Every rank computes the same sequence; the loader state stays
one global counter (order.py), so a resume may change the rank count, not the batch.
The uneven tail is dropped as in v1 (`order.plan_epoch`).
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import ConfigError
from loongforge.train.order import rank_positions


def block_sequence(groups: np.ndarray, seed: int, epoch: int, *, run: int, window: int,
                   keep: np.ndarray | None = None) -> np.ndarray:
    """This epoch's order of the sample ids 0..n-1 (those where `keep` is True).

    `groups`: per sample id, its block group (ascending, as `SampleTable.block_groups`)."""
    if run < 1 or window < 1:
        raise ConfigError(f"data.block_run {run} / data.block_window {window}: both must be >= 1")
    ids = np.arange(len(groups), dtype=np.int64)
    if keep is not None:
        ids = ids[np.asarray(keep, bool)]
    if not len(ids):
        return ids
    g = np.asarray(groups, np.int64)[ids]
    rng = np.random.default_rng([seed, epoch, 2])  # its own stream: v1's use [seed, epoch] and [.., 1]
    # 1. shuffle inside each group, number the runs of each group
    within = rng.random(len(ids))
    o = np.lexsort((within, g))
    ids, g = ids[o], g[o]
    new_group = np.r_[True, g[1:] != g[:-1]]
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(g)), 0))
    run_in_group = (np.arange(len(g)) - group_start) // run
    # 2. permute the groups (ranks of random keys: no dense array over all group numbers)
    _, gidx = np.unique(g, return_inverse=True)
    group_key = rng.permutation(int(gidx.max()) + 1)[gidx]
    o = np.lexsort((run_in_group, group_key))  # stable: a run's samples stay together and in order
    ids, run_in_group, group_key = ids[o], run_in_group[o], group_key[o]
    run_id = np.cumsum(np.r_[True, (run_in_group[1:] != run_in_group[:-1]) | (group_key[1:] != group_key[:-1])]) - 1
    # 3. shuffle runs inside windows of `window` samples (by the position of each run's first sample)
    first_pos = np.flatnonzero(np.r_[True, run_id[1:] != run_id[:-1]])
    run_window = first_pos // window
    run_key = rng.random(len(first_pos))
    run_order = np.lexsort((run_key, run_window))
    rank_of_run = np.empty_like(run_order)
    rank_of_run[run_order] = np.arange(len(run_order))
    o = np.lexsort((np.arange(len(ids)), rank_of_run[run_id]))
    return ids[o]


def rank_slice(seq: np.ndarray, consumed: int, global_batch: int, rank: int, world: int) -> np.ndarray:
    """This rank's contiguous slice of the global batch at in-epoch position `consumed`."""
    rank_positions(global_batch, rank, world)  # validates rank/world/divisibility with the v1 messages
    if consumed % global_batch:
        raise ConfigError(f"in-epoch counter {consumed} is not a multiple of the global batch {global_batch}; "
                          "resume with the global batch size the run was started with")
    if consumed + global_batch > len(seq):
        raise IndexError(f"global batch at {consumed} runs past the epoch ({len(seq)} samples)")
    per = global_batch // world
    start = consumed + rank * per
    return seq[start:start + per]


def batch_diversity(seq: np.ndarray, episodes: np.ndarray, times: np.ndarray, groups: np.ndarray,
                    batch: int, max_batches: int = 200) -> dict:
    """Diversity of the first batches of `seq`: mean distinct episodes and blocks per batch
    (as fractions of the batch), the share of sample pairs from the same episode, and the
    mean |t_i - t_j| over those same-episode pairs. For comparing orders on equal data."""
    n = min(len(seq) // batch, max_batches)
    eps, blks, same, spread = [], [], [], []
    for b in range(n):
        ids = seq[b * batch:(b + 1) * batch]
        e, t = episodes[ids], times[ids]
        eps.append(len(np.unique(e)) / batch)
        blks.append(len(np.unique(groups[ids])) / batch)
        pair_same = e[:, None] == e[None, :]
        np.fill_diagonal(pair_same, False)
        pairs = batch * (batch - 1)
        same.append(pair_same.sum() / pairs)
        if pair_same.any():
            spread.append(float(np.abs(t[:, None] - t[None, :])[pair_same].mean()))
    return {"batches": n, "distinct_episodes": float(np.mean(eps)), "distinct_blocks": float(np.mean(blks)),
            "same_episode_pairs": float(np.mean(same)),
            "same_episode_dt": float(np.mean(spread)) if spread else float("nan")}
