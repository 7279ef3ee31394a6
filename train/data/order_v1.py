"""Deterministic global sample order: pure functions of (shard sizes, seed, epoch).

Every rank computes the same global sequence, then takes its own slice, so no
rank ever needs to ask another what to read:

1. shards are permuted with numpy `default_rng([seed, epoch])`;
2. their samples are laid end to end and shuffled within consecutive windows
   of W samples (a bounded shuffle buffer), so a window touches at most
   ceil(W / shard size) + 1 shards and shard locality stays high;
3. global batch b is positions [b*G, (b+1)*G) of that sequence; position p of
   the batch goes to data-parallel rank p % world (balanced, disjoint).

Uneven tail: the last partial global batch of an epoch is DROPPED (and counted
in `EpochPlan.dropped`). Every rank therefore runs exactly `steps` steps per
epoch — ranks with different batch counts deadlock in allreduce (webdataset
#188). We drop rather than pad because padding repeats samples within an
epoch; the dropped samples differ every epoch, since the order does.

The loader state is one global in-epoch counter (samples consumed by all ranks
together) plus the epoch, never per-rank cursors, so a resume may change the
data-parallel degree as long as the global batch size stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EpochPlan:
    samples: int  # samples in the dataset
    global_batch: int
    steps: int  # full global batches this epoch
    dropped: int  # samples of the tail batch left out this epoch


def plan_epoch(num_samples: int, global_batch: int) -> EpochPlan:
    if num_samples < global_batch:
        raise ConfigError(f"data.global_batch_size: {global_batch} exceeds the {num_samples} samples of the "
                          "dataset; lower --batch-size")
    steps = num_samples // global_batch
    return EpochPlan(num_samples, global_batch, steps, num_samples - steps * global_batch)


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_shards)


def epoch_sequence(shard_sizes: Sequence[int], seed: int, epoch: int, window: int,
                   keep: np.ndarray | None = None) -> np.ndarray:
    """Global sample numbers (index order) in this epoch's training order; int64, a permutation
    (of the samples where `keep` is True: the training split, when the index has one)."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    perm = shard_order(len(sizes), seed, epoch)
    seq = np.concatenate([np.arange(starts[s], starts[s] + sizes[s], dtype=np.int64) for s in perm]) \
        if len(sizes) else np.zeros(0, np.int64)
    if window > 1 and len(seq):
        # A different stream from the shard permutation, so changing W leaves the shard order alone.
        keys = np.random.default_rng([seed, epoch, 1]).random(len(seq))
        block = np.arange(len(seq)) // window
        seq = seq[np.lexsort((keys, block))]
    if keep is not None:
        # After the shuffle, so the split leaves the order of the kept samples and its locality alone.
        seq = seq[np.asarray(keep, bool)[seq]]
    return seq


def rank_positions(global_batch: int, rank: int, world: int) -> np.ndarray:
    """Positions inside a global batch that belong to `rank`: p % world == rank."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} / world {world}: need 0 <= rank < world")
    if global_batch % world:
        raise ConfigError(f"data.global_batch_size: {global_batch} is not divisible by the {world} data-parallel "
                          "ranks; pick a multiple so every rank gets the same micro batch")
    return np.arange(rank, global_batch, world, dtype=np.int64)


def rank_batch(seq: np.ndarray, consumed: int, global_batch: int, rank: int, world: int) -> np.ndarray:
    """This rank's sample numbers of the global batch starting at in-epoch position `consumed`."""
    if consumed % global_batch:
        raise ConfigError(f"in-epoch counter {consumed} is not a multiple of the global batch {global_batch}; "
                          "resume with the global batch size the run was started with")
    if consumed + global_batch > len(seq):
        raise IndexError(f"global batch at {consumed} runs past the epoch ({len(seq)} samples)")
    return seq[consumed + rank_positions(global_batch, rank, world)]


def advance(epoch: int, consumed: int, plan: EpochPlan) -> tuple[int, int]:
    """(epoch, in-epoch counter) after one global batch; rolls over, dropping the tail."""
    consumed += plan.global_batch
    if consumed + plan.global_batch > plan.samples:
        return epoch + 1, 0
    return epoch, consumed


def upcoming_shards(seq: np.ndarray, consumed: int, count: int, shard_starts: np.ndarray,
                    shard_names: Sequence[str]) -> list[str]:
    """Names of the shards the next `count` global positions touch, in order of first use
    (what a rank announces to the cache daemon so it can prefetch)."""
    window = seq[consumed:consumed + count]
    shard_nos = np.searchsorted(shard_starts, window, side="right") - 1
    _, first = np.unique(shard_nos, return_index=True)
    return [shard_names[int(shard_nos[i])] for i in sorted(first)]
