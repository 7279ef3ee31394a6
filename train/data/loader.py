"""BlockLoader: the public data-loading API (trainer, tune, eval, benchmarks, notebooks).

    loader = BlockLoader(root, batch_size=64, num_workers=4, deltas=DeltaSpec(video=(0,), action_horizon=16),
                         rank=r, world=w, device="cuda")
    for batch in loader: ...          # dict of tensors, already on `device`
    state = loader.state_dict()       # versioned; resume continues the exact sequence
    loader.close()

`batch_size` is the GLOBAL batch (all ranks together); each rank gets batch_size // world
samples per step, a contiguous slice of the global batch (order.py: the dropped tail too).
Samples are (episode, t) derived from the memory-mapped episode lengths (samples.py), the
order is block-aware (order.py: runs of a block on one rank, a bounded window), and each
decode worker opens the dataset itself and keeps decoded blocks in a byte-bounded LRU
(fill.py). A batch dict holds: frames {camera slot: (B, K, 3, h, w) float RGB normalized,
or (B, K, 3h/2, w) uint8 NV12 with rgb=False} with K = len(video deltas), state (B, K, Ds)
and action (B, H, Da) float32 as N1.6's processor makes them (state_action.py: per modality key,
relative actions, the root's statistics), action_valid (B, H) (False on padded rows with action_pad
last/zero: the loss ignores them), frame_mask (B, K)
(False only for a bad sample), task_tokens / task_mask (B, L): the model's prompt ids, left-padded,
and their mask (`prompts`, the trainer's; without one, the task text's bytes), sample_valid (B,) (False = bad
sample masked out), sample_ids (B,) global sample numbers. On CUDA tensors are fresh and ordered on the
current stream. On CPU they are recycled memory (prefetch.HostPool) or, NV12 out from workers, the
shared-memory slot the worker filled, lent without a copy (prefetch.SlotLender); either is reused only
once nothing holds the batch any more, so a batch the caller keeps is never overwritten.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.shared.index import FORMAT_VERSION  # of the shard root, in the state: a resume reads the same kind
from loongforge.train.data import order
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.fill import FillerSpec
from loongforge.train.data.prefetch import HostPool, Prefetcher, SlotLender, resolve_device
from loongforge.train.data.prompt import PromptTable
from loongforge.train.data.samples import DeltaSpec, SampleTable, sample_lengths
from loongforge.train.data.state_action import StateAction, root_embodiment
from loongforge.train.data.sources import SourceSpec, close_source, make_source
from loongforge.train.data.workers import DecodePool

log = logging.getLogger(__name__)
LOADER_STATE_VERSION = 1
ANNOUNCE_BATCHES = 8  # global batches before an epoch's end at which the next epoch is announced
DEFAULT_RUN = 4  # samples of one block kept together (measured: benchmarks/README.md, "Format 2: loader row and block order")
DEFAULT_WINDOW = 65536  # samples; the shuffle buffer of runs (benchmarks/README.md, same section)
DEFAULT_CACHE_MB = 256
LEND_EXTRA = 2  # slots lent beyond the prefetch queue's: the batch with the consumer and the one being staged


def train_episodes(ds: Dataset) -> np.ndarray | None:
    """Bool per episode (True = training) from the dataset's split; None when unsplit."""
    flags = ~np.asarray(ds.val_mask, bool)  # per episode row of the tables, memory-mapped ids
    return None if flags.all() else flags


class BlockLoader:
    def __init__(self, root: str, *, batch_size: int, num_workers: int = 0, seed: int = 0, rank: int = 0,
                 world: int = 1, dataset: Dataset | None = None, device: str | torch.device = "cpu",
                 rgb: bool = True, deltas: DeltaSpec = DeltaSpec(), stride: int = 1, block_run: int = DEFAULT_RUN,
                 block_window: int = DEFAULT_WINDOW, block_cache_mb: float = DEFAULT_CACHE_MB,
                 max_text_tokens: int = 32, bad_samples: str = "skip", prefetch: int = 2,
                 max_steps: int | None = None, timeout_s: float = 120.0, start_method: str = "spawn",
                 image_mean: float = 0.5, image_std: float = 0.5, train_only: bool = True,
                 source: SourceSpec | None = None, drop_last: bool = True, prompts: PromptTable | None = None,
                 recycle_buffers: bool = True, state_action: StateAction | None = None, keys: dict | None = None,
                 cameras: tuple[str, ...] | None = None, raw: bool = False, step_batch: int | None = None):
        self.ds = dataset if dataset is not None else open_root(root)
        self.prompts = prompts  # the model's prompt per task (the trainer's); None = the task text's bytes
        info = self.ds.info
        self.deltas, self.stride, self.run, self.window = deltas, stride, block_run, block_window
        if state_action is None or keys is None:  # the root's own embodiment and statistics
            found = root_embodiment(info, self.ds)
            state_action, keys = StateAction(found.config, found.statistics, tag=found.tag), found.layout
        self.state_action, self.keys, self.raw = state_action, keys, raw
        self.cameras = tuple(cameras) if cameras is not None else tuple(info.slots)
        self.table = SampleTable(sample_lengths(self.ds.episode_lengths, deltas), stride=stride)
        # Per episode, not per sample: the order is built per (episode, block) group (order.EpochOrder).
        self.train_eps = train_episodes(self.ds) if train_only else None
        self.block_size = int(self.ds.block_size)
        order.block_sequence(np.zeros(1, np.int64), 0, 0, run=block_run, window=block_window)  # validate now
        self.index = self.ds.shard_index  # shards only: what the cache client needs
        self.source_spec = source or SourceSpec(root=root)
        self._episode_shard = np.asarray(self.ds.tables["episode_shard"])
        self._names = [s["name"] for s in self.ds.manifest["shards"]]
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = batch_size
        per_rank = order.check_layout(batch_size, rank, world)  # now, not mid-run
        n = self.table.num_samples if self.train_eps is None else \
            int(self.table.counts[np.asarray(self.train_eps, bool)].sum())
        # drop_last=False: the epoch's last, partial batch too (the LeRobot adapter; order.py "Uneven tail").
        self.plan = order.plan_epoch(n, batch_size, drop_last, step_batch=step_batch)
        self.device = resolve_device(device)
        self.num_workers, self.prefetch, self.max_steps = num_workers, prefetch, max_steps
        if block_cache_mb < 0:
            raise ConfigError(f"data.block_cache_mb: {block_cache_mb}, must be >= 0 (0 = no cache)")
        self.filler_spec = self._filler(root, per_rank, max_text_tokens, int(block_cache_mb * (1 << 20)))
        self.layout = self.filler_spec.layout
        # NV12 out on CPU from workers: batches are lent out of the ring (no copy), at most prefetch + LEND_EXTRA at once,
        # each with a slot of its own beside the 2W+1 the workers cycle through.
        self.lend = num_workers > 0 and not rgb and recycle_buffers and self.device.type == "cpu" and \
            SlotLender.available()
        slots = max(2, num_workers * 2 + 1) + (prefetch + LEND_EXTRA if self.lend else 0)
        # The workers' block caches in (episode, block) keys of every camera: what block affinity models.
        key_bytes = self.block_size * info.timestep_bytes
        self._pool_args = dict(num_workers=num_workers, slots=slots, policy=bad_samples, timeout_s=timeout_s,
                               start_method=start_method,
                               affinity_blocks=int(block_cache_mb * (1 << 20)) // max(1, key_bytes))
        self._conv = dict(matrix=info.color_matrix, color_range=info.color_range, mean=image_mean, std=image_std)
        self.rgb = rgb
        self.recycle = recycle_buffers  # False: a fresh CPU output buffer per batch (the benchmark's A/B baseline)
        self.epoch, self.consumed, self.steps_done, self.dropped = 0, 0, 0, 0
        self._orders: dict[int, order.EpochOrder] = {}  # this epoch and, near its end, the next
        self._pool: DecodePool | None = None
        self._lender: SlotLender | None = None
        self._prefetcher: Prefetcher | None = None
        self._announcer = None
        self._announced_epoch, self._announced_next = -1, -1

    def _filler(self, root: str, per_rank: int, max_text_tokens: int, cache_bytes: int) -> FillerSpec:
        """The batch layout and what fills it in a decode worker: the trainer's samples (fill.py).
        A subclass shapes other items over the same order, pool and prefetcher (lerobot_loader.py)."""
        info, deltas, sa = self.ds.info, self.deltas, self.state_action
        text_len = max_text_tokens if self.prompts is None else self.prompts.length
        sizes = tuple(info.camera_size(i) for i in range(len(info.cameras)))
        layout = BatchLayout(per_rank, tuple(info.slots), info.height, info.width, deltas.frames, sa.state_dim,
                             sa.action_dim, deltas.action_horizon, text_len,
                             sizes=() if info.uniform_size else sizes,
                             raw_state_dim=sa.raw_state_dim if self.raw else 0,
                             raw_action_dim=sa.action_dim if self.raw else 0)
        return FillerSpec(root, deltas, layout, cache_bytes, self.source_spec, self.prompts, sa, self.keys)

    @property
    def num_samples(self) -> int:
        return self.table.num_samples

    # -- order ---------------------------------------------------------------
    def epoch_order(self, epoch: int) -> order.EpochOrder:
        """The epoch's order, built per group; each rank expands only its own slices."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order.EpochOrder(self.table, self.block_size, self.seed, epoch, run=self.run,
                                                   window=self.window, train_episodes=self.train_eps)
        return self._orders[epoch]

    def sequence(self, epoch: int) -> np.ndarray:
        """The whole epoch's sequence (O(samples): for analysis and tests, not the training path)."""
        seq_order = self.epoch_order(epoch)
        return seq_order.ids(0, seq_order.num_samples)

    def plans(self):
        """(meta, items) for each upcoming batch of this rank, from the current state (also what the
        ablation baseline serves, so both loaders read the same samples in the same order)."""
        epoch, consumed, step = self.epoch, self.consumed, self.steps_done
        while self.max_steps is None or step < self.max_steps:
            ids = self.epoch_order(epoch).rank_ids(consumed, self.global_batch, self.rank, self.world,
                                                   tail=not self.plan.drop_last)
            eps, ts = self.table.locate(ids)
            self._announce(epoch, consumed)
            items = list(zip(ids.tolist(), eps.tolist(), ts.tolist()))
            nxt_epoch, nxt_consumed = order.advance(epoch, consumed, self.plan)
            meta = {"epoch": epoch, "consumed": consumed, "step": step, "next_epoch": nxt_epoch,
                    "next_consumed": nxt_consumed, "sample_ids": ids.copy()}
            yield meta, items
            epoch, consumed, step = nxt_epoch, nxt_consumed, step + 1

    def _announce(self, epoch, consumed) -> None:
        """Tell the cache this rank's shard order: the rest of the epoch once (so it can evict
        by farthest next use, not LRU), and, within ANNOUNCE_BATCHES of the epoch's end, the
        whole next epoch too (prefetch across the seam). A shard is where a sample's episode lives."""
        if self._announcer is None:
            return
        end = min(self.plan.steps * self.global_batch, self.plan.samples)
        if epoch != self._announced_epoch:
            if self._announced_next != epoch:  # else sent whole near the last epoch's end
                self._send_plan(epoch, consumed, end)
            self._announced_epoch = epoch
        if end - consumed <= ANNOUNCE_BATCHES * self.global_batch and self._announced_next != epoch + 1:
            self._send_plan(epoch + 1, 0, end)
            self._announced_next = epoch + 1

    def _send_plan(self, epoch: int, consumed: int, end: int) -> None:
        if consumed >= end:
            return
        # Per window of runs, not per sample: no in-group shuffle is drawn for the announcement.
        seen, shards = np.zeros(len(self._names), bool), []
        chunks = self.epoch_order(epoch).rank_episodes(consumed, end, self.global_batch, self.rank, self.world)
        for eps in chunks:  # shard order = first appearance in this rank's batches
            nos = self._episode_shard[eps]
            _, first = np.unique(nos, return_index=True)
            for no in nos[np.sort(first)]:
                if not seen[no]:
                    seen[no] = True
                    shards.append(self._names[int(no)])
        try:
            self._announcer.announce(shards, rank=self.rank, epoch=epoch)
        except Exception as exc:  # noqa: BLE001 - the cache is an accelerator; training goes on without it
            log.warning("cache announce failed (%s); continuing without prefetch hints", exc)

    # -- iteration -------------------------------------------------------------
    def _start(self) -> None:
        self._stop_pipeline()
        self._pool = DecodePool(self.filler_spec, **self._pool_args)
        if self.source_spec.wants_cache:
            cand = make_source(self.source_spec, self.index)
            self._announcer = cand if hasattr(cand, "announce") else None
            if self._announcer is None:
                close_source(cand)
        self._announced_epoch, self._announced_next = -1, -1
        plans, pool, layout, bs = self.plans(), self._pool, self.layout, self.block_size
        inflight: list[tuple[int, dict]] = []
        counter = iter(range(1 << 62))
        host = HostPool.for_prefetch(self.prefetch, self.recycle)
        # Inline decode on CPU fills each batch straight into recycled output memory, handed out as it is;
        # workers fill shared-memory slots, which the prefetcher copies out before releasing them.
        direct = self.num_workers == 0 and self.device.type == "cpu"
        lender = self._lender = SlotLender(pool, self.prefetch + LEND_EXTRA) if self.lend else None

        def pull():
            if lender is not None:
                lender.reclaim()
            while pool.free_slots > 1 or (pool.free_slots and not inflight):
                nxt = next(plans, None)
                if nxt is None:
                    break
                meta, items = nxt
                seq = next(counter)
                pool.submit(seq, items, {(e, t // bs) for _, e, t in items} if pool.num_workers else ())
                inflight.append((seq, meta))
            if not inflight:
                raise StopIteration
            seq, meta = inflight.pop(0)
            if direct:
                buf = host.take((layout.nbytes,), torch.uint8, "batch")
                slot, arrays = pool.get(seq, out=buf.numpy())
                arrays = {name: torch.from_numpy(a) for name, a in arrays.items()}  # views of buf: kept alive
            else:
                slot, arrays = pool.get(seq)
                lent = lender.lend(slot) if lender is not None else None
                if lent is not None:  # tensors over the slot, handed out as they are; reclaim() frees it
                    meta["bad_samples"] = pool.bad_samples
                    return meta, lent, lambda: None
            meta["bad_samples"] = pool.bad_samples
            return meta, arrays, lambda: pool.release(slot)

        self._prefetcher = Prefetcher(pull, device=self.device, rgb=self.rgb, depth=self.prefetch,
                                      timeout_s=self._pool_args["timeout_s"] * 2, host=host, **self._conv)

    def __iter__(self):
        self._start()
        return self

    def __next__(self) -> dict:
        if self._prefetcher is None:
            self._start()
        staged = next(self._prefetcher)
        m = staged.meta
        # State advances when a batch is handed out, not when it is staged ahead.
        if m["next_epoch"] != m["epoch"]:
            self.dropped += self.plan.dropped
        self.epoch, self.consumed, self.steps_done = m["next_epoch"], m["next_consumed"], m["step"] + 1
        batch = staged.tensors
        batch["meta"] = m
        return batch

    @property
    def bad_samples(self) -> int:
        return self._pool.bad_samples if self._pool else 0

    def wait_ready(self, timeout_s: float = 120.0) -> int:
        """Block until every decode worker is past start-up (call after the first batch).
        Returns how many batches may already be decoded ahead (ring slots + prefetch queue):
        a throughput window that skips them times decoding, not a queue filled while waiting."""
        if self._pool is None:
            raise RuntimeError("wait_ready() before the first batch: iterate the loader first")
        if self.num_workers == 0:
            return self.prefetch
        self._pool.wait_ready(timeout_s)
        return self._pool_args["slots"] + self.prefetch

    def cache_counters(self) -> dict:
        """Block-cache hits/misses/evictions summed over the decode workers (as last reported)."""
        out: dict[str, int] = {}
        for c in (self._pool.worker_counters.values() if self._pool else ()):
            for key, v in c.items():
                out[key] = out.get(key, 0) + v
        return out

    # -- state -------------------------------------------------------------------
    def _order_key(self) -> dict:
        return {"stride": self.stride, "block_run": self.run, "block_window": self.window,
                "video_deltas": list(self.deltas.video), "block_size": self.block_size}

    def state_dict(self) -> dict:
        return {"version": LOADER_STATE_VERSION, "format_version": FORMAT_VERSION, "seed": self.seed,
                "epoch": self.epoch, "consumed": self.consumed, "global_batch": self.global_batch,
                "steps_done": self.steps_done, "dropped": self.dropped, "num_samples": self.num_samples,
                "epoch_samples": self.plan.steps * self.global_batch, "order": self._order_key()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION or state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"loader state version {state.get('version')!r} / format "
                                  f"{state.get('format_version', 1)!r}: this loader reads a format-{FORMAT_VERSION} "
                                  f"state of version {LOADER_STATE_VERSION}; resume with the LoongForge that wrote "
                                  "it, on the shard root the run started on")
        # Rank slices and micro batches are both contiguous stretches of the order, which does not depend on the
        # batch: another loader batch with the same optimizer-step batch (an elastic resume on fewer ranks: grad
        # accum absorbs them) reads the same global positions (_same_positions).
        mine = (("global_batch", self.global_batch), ("seed", self.seed), ("num_samples", self.num_samples),
                ("order", self._order_key()))
        for key, value in mine:
            if state[key] != value and not (key == "global_batch" and self._same_positions(state)):
                raise CheckpointError(f"checkpoint has {key}={state[key]} but this run has {value}: the sample "
                                      f"sequence would change; resume with the same {key}")
        self._stop_pipeline()
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.steps_done, self.dropped = int(state["steps_done"]), int(state["dropped"])
        self.steps_done = self.steps_done * int(state["global_batch"]) // self.global_batch

    def _same_positions(self, state: dict) -> bool:
        """Another loader batch reads the same global positions when the resume point is on a batch boundary
        and each epoch uses the same number of samples (same tail dropped)."""
        old, n = int(state["global_batch"]), self.plan.samples
        used = int(state.get("epoch_samples", n // old * old))  # absent: written before step_batch existed
        return int(state["consumed"]) % self.global_batch == 0 and used == self.plan.steps * self.global_batch

    def _stop_pipeline(self) -> None:
        # Order matters: wake the prefetch thread out of pool.get first, then join it, and only
        # then free the pool (its slots may be under the thread's copy until the join returns).
        if self._pool is not None:
            self._pool.interrupt()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._lender is not None:
            self._lender.close()
            self._lender = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._announcer is not None:
            close_source(self._announcer)
            self._announcer = None

    def close(self) -> None:
        self._stop_pipeline()
        close = getattr(self.ds, "close", None)
        if callable(close):
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
