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

    `groups`: per sample id, its block group (ascending, as `SampleTable.block_groups`).
    O(n log B + R log R) for R = n/run runs: no sort over all n samples (10 M samples: a
    global 3-key lexsort took 12.7 CPU-s and 1.2 GB on the loaded VM)."""
    if run < 1 or window < 1:
        raise ConfigError(f"data.block_run {run} / data.block_window {window}: both must be >= 1")
    ids = np.arange(len(groups), dtype=np.int64)
    if keep is not None:
        ids = ids[np.asarray(keep, bool)]
    if not len(ids):
        return ids
    g = np.asarray(groups, np.int64)[ids]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    sizes = np.diff(np.r_[starts, len(g)])
    rng = np.random.default_rng([seed, epoch, 2])  # its own stream: v1's use [seed, epoch] and [.., 1]
    # 1. shuffle inside each group: one row of random keys per group (groups hold <= B samples)
    slot = np.arange(sizes.max())[None, :]
    real = slot < sizes[:, None]
    keys = rng.random(real.shape)
    keys[~real] = 2.0  # padding sorts last
    shuffled = ids[(starts[:, None] + np.argsort(keys, axis=1))[real]]  # group by group, shuffled inside
    # 2. runs of each group; groups permuted; runs laid end to end in that order
    n_runs = -(-sizes // run)
    run_group = np.repeat(np.arange(len(sizes)), n_runs)
    run_k = np.arange(len(run_group)) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
    run_len = np.minimum(run, sizes[run_group] - run_k * run)
    run_start = starts[run_group] + run_k * run  # where the run's samples sit in `shuffled`
    group_rank = np.empty(len(sizes), np.int64)
    group_rank[rng.permutation(len(sizes))] = np.arange(len(sizes))
    laid = np.lexsort((run_k, group_rank[run_group]))
    # 3. shuffle runs inside windows of `window` samples (by where each run starts in the laid-out order)
    first_pos = np.cumsum(run_len[laid]) - run_len[laid]
    order = laid[np.argsort(first_pos // window + rng.random(len(laid)), kind="stable")]
    # expand runs to samples
    lens = run_len[order]
    offset = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return shuffled[np.repeat(run_start[order], lens) + offset]


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
