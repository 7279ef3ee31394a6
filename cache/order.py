"""The trainer's shard order, as far as the cache needs it: which shards each
rank reads, in which order, in one epoch. Pure and deterministic.

Per epoch the trainer shuffles shards with an RNG seeded from (seed, epoch),
then shuffles samples within a bounded window; only the shard sequence matters
for caching. Ranks take shard-interleaved slices of the epoch's permutation.
If the trainer publishes its own derivation, this must match it (a test in
tests/cache checks the contract it documents).
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.index import ShardIndex


def epoch_permutation(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_shards)


def rank_shard_numbers(num_shards: int, *, seed: int, epoch: int, rank: int, world: int) -> list[int]:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    return [int(i) for i in epoch_permutation(num_shards, seed, epoch)[rank::world]]


def rank_plan(index: ShardIndex, *, seed: int, epoch: int, rank: int, world: int) -> list[str]:
    """Shard names rank `rank` reads in `epoch`, in order: what it announces."""
    nums = rank_shard_numbers(len(index.shards), seed=seed, epoch=epoch, rank=rank, world=world)
    return [index.shards[i].name for i in nums]
