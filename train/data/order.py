"""Global sample order: deterministic from (seed, epoch), block-aware.

A sample's frames live in a zstd block of B consecutive frames shared by up to B/stride
samples, so a decode worker should decompress a block once and serve several samples
from it. The order:

1. samples are grouped by (episode, block of t) (`SampleTable.block_groups`); inside a
   group they are shuffled, then cut into *runs* of `run` consecutive samples;
2. groups are permuted, their runs laid end to end, and the runs shuffled inside windows
   of `window` samples (a bounded shuffle buffer at run granularity): a group's runs stay
   within about one window, so a worker's block cache (block_cache.py) sees them again;
3. global batch b is positions [b*G, (b+1)*G); rank r takes the CONTIGUOUS slice
   [r*G/world, (r+1)*G/world) of it, so a run never straddles ranks (a strided
   p % world would scatter a run over ranks and every rank would decode the block).

`run` = 1 and `window` >= the epoch is a uniform random permutation (GR00T's sampler);
larger `run` trades batch diversity for decodes (measured by `batch_diversity`, reported
in benchmarks/README.md). Every rank computes the same sequence, so no rank ever needs to
ask another what to read.

Uneven tail: the last partial global batch of an epoch is DROPPED (and counted in
`EpochPlan.dropped`); under gradient accumulation in whole optimizer steps (`plan_epoch`'s
`step_batch`), so a run in micro-batches reads each epoch's samples as one without them. Every
rank therefore runs exactly `steps` steps per epoch: ranks with different batch counts deadlock
in allreduce (webdataset #188). We drop rather than
pad because padding repeats samples within an epoch; the dropped samples differ every
epoch, since the order does. With `drop_last=False` (the LeRobot adapter, as a DataLoader)
the tail is one more, smaller global batch, split over the ranks in contiguous slices as
evenly as it goes (every rank still runs the same number of steps; a rank's slice may be
empty): every sample exactly once per epoch, none repeated.

The loader state is one global in-epoch counter (samples consumed by all ranks together)
plus the epoch, never per-rank cursors, so a resume may change the data-parallel degree
(and the loader batch, see loader.py) as long as the positions read stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EpochPlan:
    samples: int  # samples in the dataset (the training split)
    global_batch: int
    steps: int  # global batches this epoch (full ones, plus the tail's when it is kept)
    dropped: int  # samples of the tail batch left out this epoch
    drop_last: bool = True


def plan_epoch(num_samples: int, global_batch: int, drop_last: bool = True, *,
               step_batch: int | None = None) -> EpochPlan:
    """`step_batch`: the optimizer step's batch when a step is several loader batches (gradient
    accumulation: `global_batch` is then one micro-batch of all ranks). The tail is dropped in whole
    steps, so a run split into micro-batches reads, epoch by epoch, the samples of one that is not."""
    unit = step_batch or global_batch
    if unit % global_batch:
        raise ConfigError(f"the step's batch {unit} is not a multiple of the loader's {global_batch}")
    if num_samples < (unit if drop_last else 1):
        raise ConfigError(f"data.global_batch_size: {unit} exceeds the {num_samples} samples of the "
                          "dataset; lower --batch-size")
    if not drop_last:
        return EpochPlan(num_samples, global_batch, -(-num_samples // global_batch), 0, False)
    steps = num_samples // unit * (unit // global_batch)
    return EpochPlan(num_samples, global_batch, steps, num_samples - steps * global_batch)


def advance(epoch: int, consumed: int, plan: EpochPlan) -> tuple[int, int]:
    """(epoch, in-epoch counter) after one global batch; rolls over after the epoch's last batch (the
    tail dropped unless kept)."""
    consumed += plan.global_batch
    if consumed >= (plan.steps * plan.global_batch if plan.drop_last else plan.samples):
        return epoch + 1, 0
    return epoch, consumed


def rank_range(consumed: int, global_batch: int, rank: int, world: int, n: int,
               tail: bool = False) -> tuple[int, int]:
    """Positions [a, b) of this rank in the global batch at `consumed`: a contiguous slice of
    global_batch / world, or, in a kept tail (`tail`) shorter than the batch, of what is left."""
    _check_slice(consumed, global_batch, rank, world, n, tail)
    left = min(global_batch, n - consumed)
    return consumed + rank * left // world, consumed + (rank + 1) * left // world


def check_layout(global_batch: int, rank: int, world: int) -> int:
    """The per-rank micro batch of a data-parallel layout; ConfigError unless every rank gets the same one."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} / world {world}: need 0 <= rank < world")
    if global_batch % world:
        raise ConfigError(f"data.global_batch_size: {global_batch} is not divisible by the {world} data-parallel "
                          "ranks; pick a multiple so every rank gets the same micro batch")
    return global_batch // world


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
    rng = np.random.default_rng([seed, epoch, 2])  # stream 2: what checkpoints of this order expect
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


class EpochOrder:
    """This epoch's `block_sequence`, position for position, without building it.

    `block_sequence` holds ~5 int64 arrays per sample on every rank (10 M samples: ~0.9 GB
    peak; the issue's 100 M+ is ~9 GB a rank). Here construction is O(groups): the group
    permutation and each group's laid-out position (~32 bytes a group, a group being up
    to B/stride samples). A window's runs are sorted when a position in it is first asked
    for (O(window), the last two kept), and only the runs overlapping the asked positions
    are expanded to samples. The random draws are the very ones `block_sequence` makes:
    one PCG64 stream, jumped (`advance`) to a group's row of in-group keys or a window's
    run keys, so a checkpoint of either resumes on the other. `window` >= the epoch makes
    one window of every run: O(runs) then, as a uniform shuffle must be."""

    def __init__(self, table, block_size: int, seed: int, epoch: int, *, run: int, window: int,
                 train_episodes: np.ndarray | None = None):
        if run < 1 or window < 1:
            raise ConfigError(f"data.block_run {run} / data.block_window {window}: both must be >= 1")
        first, size, episode = table.group_table(block_size, train_episodes)
        self.run, self.window = run, window
        self.num_samples = int(size.sum())
        self._width = int(size.max()) if len(size) else 0  # block_sequence's key row length
        self._gen = np.random.default_rng([seed, epoch, 2])
        self._bits = self._gen.bit_generator  # jumped with advance(); self._gen draws from wherever it stands
        self._keys_state = self._bits.state  # draws 0 .. G*width-1: a row of in-group keys per group
        self._bits.advance(len(size) * self._width)
        perm = self._gen.permutation(len(size))
        self._runs_state = self._bits.state  # then one key per run, in laid-out order
        # Per group, int32 while sample ids fit (2^31 samples: ~3 years of 20 fps video): 24 bytes a group.
        small = np.int32 if int(table.num_samples) + window < 2**31 else np.int64
        self.group = perm.astype(small)  # laid-out -> group row
        del perm
        self.first, self.size = first[self.group].astype(small), size[self.group].astype(small)
        self.episode = episode[self.group].astype(small)
        del first, size, episode
        self.start = (np.cumsum(self.size, dtype=np.int64) - self.size).astype(small)  # laid-out sample position
        nruns = -(-self.size // run)
        self.run0 = (np.cumsum(nruns, dtype=np.int64) - nruns).astype(small)  # laid-out number of its first run
        self._last = self.start.astype(np.int64) + (nruns - 1) * run  # where its last run starts
        del nruns
        n_win = -(-self.num_samples // window)
        # Output position where window w begins = laid position of its first run (runs are laid end to end).
        self.win_out = self._first_run_at(np.arange(n_win + 1, dtype=np.int64) * window)
        self._win_first = np.searchsorted(self._last, np.arange(n_win, dtype=np.int64) * window, "left")
        del self._last  # only the windows' first groups were needed
        self._windows: dict[int, tuple] = {}

    def _first_run_at(self, x: np.ndarray) -> np.ndarray:
        if not len(self.start):
            return np.full(len(x), self.num_samples, np.int64)
        i = np.minimum(np.searchsorted(self._last, x, "left"), len(self.start) - 1)  # _last is increasing
        st = self.start[i].astype(np.int64)
        k = np.maximum(0, -(-(x - st) // self.run))
        return np.where(x <= self._last[-1], st + k * self.run, self.num_samples)

    def _runs(self, w: int) -> tuple:
        """Window w's runs in output order: (laid group, run number, length, cumulative length)."""
        if w in self._windows:
            return self._windows[w]
        lo, hi = w * self.window, (w + 1) * self.window
        gi = np.arange(self._win_first[w], np.searchsorted(self.start, hi, "left"))
        st, sz = self.start[gi].astype(np.int64), self.size[gi].astype(np.int64)
        k0 = np.maximum(0, -(-(lo - st) // self.run))
        k1 = np.minimum(-(-sz // self.run), -(-(hi - st) // self.run))
        cnt = np.maximum(k1 - k0, 0)
        run_g = np.repeat(gi, cnt)
        run_k = np.repeat(k0, cnt) + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        j = self.run0[run_g].astype(np.int64) + run_k  # consecutive: a stretch of the laid-out runs
        keys = self._draw(self._runs_state, int(j[0]), len(j)) if len(j) else np.zeros(0)  # run > window: none
        order = np.argsort(w + keys, kind="stable")  # block_sequence's `first_pos // window + key`, stable
        run_g, run_k = run_g[order], run_k[order]
        lens = np.minimum(self.run, self.size[run_g].astype(np.int64) - run_k * self.run)
        out = (run_g, run_k, lens, np.cumsum(lens))
        if len(self._windows) >= 2:
            self._windows.pop(next(iter(self._windows)))
        self._windows[w] = out
        return out

    def _draw(self, state: dict, skip: int, count: int) -> np.ndarray:
        self._bits.state = state
        self._bits.advance(skip)
        return self._gen.random(count)

    def _shuffled(self, laid: np.ndarray) -> np.ndarray:
        """(len(laid), width) sample ids: each group's samples in block_sequence's in-group order."""
        rows = np.empty((len(laid), self._width))
        row_no = self.group[laid].astype(np.int64)
        self._bits.state = self._keys_state  # one reset; then jump forward from row to row, lowest first
        at = 0
        for i in np.argsort(row_no).tolist():
            start = int(row_no[i]) * self._width
            if start > at:
                self._bits.advance(start - at)
            self._gen.random(out=rows[i])
            at = start + self._width
        rows[np.arange(self._width)[None, :] >= self.size[laid][:, None]] = 2.0  # padding sorts last
        return self.first[laid].astype(np.int64)[:, None] + np.argsort(rows, axis=1)

    def ids(self, a: int, b: int) -> np.ndarray:
        """Sample ids at positions [a, b) of the epoch's sequence."""
        if not 0 <= a <= b <= self.num_samples:
            raise IndexError(f"positions [{a}, {b}) outside the epoch's {self.num_samples} samples")
        parts, w = [], int(np.searchsorted(self.win_out, a, "right")) - 1
        while a < b:
            run_g, run_k, lens, cum = self._runs(w)
            if not len(cum):
                w += 1
                continue
            base = int(self.win_out[w])
            stop = min(b, base + int(cum[-1]))
            r0, r1 = np.searchsorted(cum, a - base, "right"), np.searchsorted(cum, stop - base - 1, "right") + 1
            uniq, inv = np.unique(run_g[r0:r1], return_inverse=True)
            rows = self._shuffled(uniq)[inv]
            lens_ = lens[r0:r1]
            off = np.arange(lens_.sum()) - np.repeat(np.cumsum(lens_) - lens_, lens_)
            col = np.repeat(run_k[r0:r1] * self.run, lens_) + off
            got = rows[np.repeat(np.arange(r1 - r0), lens_), col]
            skip = a - base - (int(cum[r0 - 1]) if r0 else 0)
            parts.append(got[skip:skip + stop - a])
            a, w = stop, w + 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def rank_ids(self, consumed: int, global_batch: int, rank: int, world: int, tail: bool = False) -> np.ndarray:
        """`rank_slice` of the sequence, expanding only this rank's slice."""
        return self.ids(*rank_range(consumed, global_batch, rank, world, self.num_samples, tail))

    def rank_episodes(self, consumed: int, end: int, global_batch: int, rank: int, world: int):
        """Episodes of this rank's samples at positions [consumed, end), window by window in
        order (repeats left in): what the cache announcement needs, without expanding a sample."""
        per = global_batch // world
        w = int(np.searchsorted(self.win_out, consumed, "right")) - 1
        while 0 <= w < len(self.win_out) - 1 and self.win_out[w] < end:
            run_g, _, lens, _ = self._runs(w)
            pos = self.win_out[w] + np.arange(int(lens.sum()))
            mine = (pos >= consumed) & (pos < end) & ((pos % global_batch) // per == rank)
            yield self.episode[run_g[np.unique(np.repeat(np.arange(len(lens)), lens)[mine])]]
            w += 1


def _check_slice(consumed: int, global_batch: int, rank: int, world: int, n: int, tail: bool = False) -> None:
    check_layout(global_batch, rank, world)
    if consumed % global_batch:
        raise ConfigError(f"in-epoch counter {consumed} is not a multiple of the global batch {global_batch}; "
                          "resume with the global batch size the run was started with")
    if consumed + (1 if tail else global_batch) > n:
        raise IndexError(f"global batch at {consumed} runs past the epoch ({n} samples)")


def rank_slice(seq: np.ndarray, consumed: int, global_batch: int, rank: int, world: int,
               tail: bool = False) -> np.ndarray:
    """This rank's contiguous slice of the global batch at in-epoch position `consumed`."""
    return seq[slice(*rank_range(consumed, global_batch, rank, world, len(seq), tail))]


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
