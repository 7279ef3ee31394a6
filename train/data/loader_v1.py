"""ShardLoader: the public data-loading API (trainer, benchmarks, notebooks).

    loader = ShardLoader(root, batch_size=8, num_workers=2, seed=0, rank=r, world=w, device="cuda")
    for batch in loader: ...          # dict of tensors, already on `device`
    state = loader.state_dict()       # versioned; resume continues the exact sequence
    loader.close()

`batch_size` is the GLOBAL batch (all ranks together); each rank gets
batch_size // world samples per step (see order.py for the slicing and the
dropped tail). A batch dict holds: frames {camera slot: (B, K, 3, h, w) float
RGB normalized, or (B, K, 3h/2, w) uint8 NV12 with rgb=False}, state (B, K, Ds)
and action (B, H, Da) float32 normalized with the index stats, action_valid
(B, H), frame_mask (B, K) (padding from length bucketing), task_tokens /
task_mask (B, L) (byte-level), sample_valid (B,) (False = bad sample masked
out), sample_ids (B,) global sample numbers. Tensors are fresh (never views of
the shared-memory ring); on CUDA they are ordered on the current stream.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.shared.index import ShardIndex, load_index
from loongforge.train.data import order_v1 as order
from loongforge.train.data.batch import BatchLayout, bucket_for, default_buckets
from loongforge.train.data.prefetch import Prefetcher, resolve_device
from loongforge.train.data.sources import SourceSpec, close_source, make_source
from loongforge.train.data.workers import DecodePool

log = logging.getLogger(__name__)
LOADER_STATE_VERSION = 1
ANNOUNCE_BATCHES = 8  # global batches before an epoch's end at which the next epoch is announced


class ShardLoader:
    def __init__(self, root: str, *, batch_size: int, num_workers: int = 0, seed: int = 0, rank: int = 0,
                 world: int = 1, index: ShardIndex | None = None, source: SourceSpec | None = None,
                 device: str | torch.device = "cpu", rgb: bool = True, shuffle_window: int = 64,
                 frame_buckets: tuple[int, ...] = (), max_text_tokens: int = 32, bad_samples: str = "skip",
                 prefetch: int = 2, max_steps: int | None = None, timeout_s: float = 120.0,
                 start_method: str = "spawn", image_mean: float = 0.5, image_std: float = 0.25,
                 subset: np.ndarray | None = None):
        self.index = index if index is not None else load_index(root)
        self.source_spec = source or SourceSpec(root=root)
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = batch_size
        order.rank_positions(batch_size, rank, world)  # validates divisibility now, not mid-run
        # subset: bool per global sample (the training split); None = every sample.
        self.subset = None if subset is None else np.asarray(subset, bool)
        self.plan = order.plan_epoch(self.index.num_samples if self.subset is None else int(self.subset.sum()),
                                     batch_size)
        self.window = shuffle_window
        max_frames = max(max(s.frames) for s in self.index.shards)
        self.buckets = tuple(frame_buckets) or default_buckets(max_frames)
        if self.buckets[-1] < max_frames:
            raise ConfigError(f"data.frame_buckets: largest bucket {self.buckets[-1]} < longest window "
                              f"{max_frames} frames in the index; add {max_frames}")
        self.layout = BatchLayout.from_index(self.index, batch_size // world, max_text_tokens, self.buckets[-1])
        self.device = resolve_device(device)
        self.num_workers, self.prefetch, self.max_steps = num_workers, prefetch, max_steps
        self._pool_args = dict(num_workers=num_workers, slots=max(2, num_workers * 2 + 1), policy=bad_samples,
                               timeout_s=timeout_s, start_method=start_method)
        ds = self.index.dataset
        self._conv = dict(matrix=ds.color_matrix, color_range=ds.color_range, mean=image_mean, std=image_std)
        self.rgb = rgb
        self._starts = np.asarray([self.index.shard_start(i) for i in range(len(self.index.shards))], np.int64)
        self._names = [s.name for s in self.index.shards]
        self.epoch, self.consumed, self.steps_done, self.dropped = 0, 0, 0, 0
        self._seq_cache: tuple[int, np.ndarray] | None = None
        self._pool: DecodePool | None = None
        self._prefetcher: Prefetcher | None = None
        self._announcer = None
        self._announced_epoch, self._announced_next = -1, -1

    # -- order ---------------------------------------------------------------
    def sequence(self, epoch: int) -> np.ndarray:
        if self._seq_cache is None or self._seq_cache[0] != epoch:
            sizes = [s.samples for s in self.index.shards]
            self._seq_cache = (epoch, order.epoch_sequence(sizes, self.seed, epoch, self.window, keep=self.subset))
        return self._seq_cache[1]

    def _plans(self):
        """(meta, k, items) for each upcoming batch of this rank, from the current state."""
        epoch, consumed, step = self.epoch, self.consumed, self.steps_done
        while self.max_steps is None or step < self.max_steps:
            seq = self.sequence(epoch)
            ids = order.rank_batch(seq, consumed, self.global_batch, self.rank, self.world)
            items = [(int(g), *self.index.locate(int(g))) for g in ids]
            k = bucket_for(max(self.index.shards[s].frames[i] for _, s, i in items), self.buckets)
            self._announce(seq, epoch, consumed)
            nxt_epoch, nxt_consumed = order.advance(epoch, consumed, self.plan)
            meta = {"epoch": epoch, "consumed": consumed, "step": step, "next_epoch": nxt_epoch,
                    "next_consumed": nxt_consumed, "sample_ids": ids.copy()}
            yield meta, k, items
            epoch, consumed, step = nxt_epoch, nxt_consumed, step + 1

    def _announce(self, seq, epoch, consumed) -> None:
        """Tell the cache this rank's shard order: the rest of the epoch once (so
        it can evict by farthest next use, not LRU), and, within ANNOUNCE_BATCHES
        of the epoch's end, the whole next epoch too (prefetch across the seam)."""
        if self._announcer is None:
            return
        end = self.plan.steps * self.global_batch
        if epoch != self._announced_epoch:
            if self._announced_next != epoch:  # else sent whole near the last epoch's end
                self._send_plan(seq, epoch, consumed, end)
            self._announced_epoch = epoch
        near_end = end - consumed <= ANNOUNCE_BATCHES * self.global_batch
        if near_end and self._announced_next != epoch + 1:
            sizes = [s.samples for s in self.index.shards]
            self._send_plan(order.epoch_sequence(sizes, self.seed, epoch + 1, self.window), epoch + 1, 0, end)
            self._announced_next = epoch + 1

    def _send_plan(self, seq, epoch: int, consumed: int, end: int) -> None:
        if consumed >= end:
            return
        mine = np.concatenate([order.rank_batch(seq, c, self.global_batch, self.rank, self.world)
                               for c in range(consumed, end, self.global_batch)])
        shards = order.upcoming_shards(mine, 0, len(mine), self._starts, self._names)
        try:
            self._announcer.announce(shards, rank=self.rank, epoch=epoch)
        except Exception as exc:  # noqa: BLE001 - the cache is an accelerator; training goes on without it
            log.warning("cache announce failed (%s); continuing without prefetch hints", exc)

    # -- iteration -------------------------------------------------------------
    def _start(self) -> None:
        self._stop_pipeline()
        self._pool = self._make_pool()
        if self.source_spec.wants_cache:
            cand = make_source(self.source_spec, self.index)
            self._announcer = cand if hasattr(cand, "announce") else None
            if self._announcer is None:
                close_source(cand)
        self._announced_epoch, self._announced_next = -1, -1
        plans, pool = self._plans(), self._pool
        inflight: list[tuple[int, dict]] = []
        counter = iter(range(1 << 62))

        def pull():
            while pool.free_slots > 1 or (pool.free_slots and not inflight):
                nxt = next(plans, None)
                if nxt is None:
                    break
                meta, k, items = nxt
                seq = next(counter)
                pool.submit(seq, k, items)
                inflight.append((seq, meta))
            if not inflight:
                raise StopIteration
            seq, meta = inflight.pop(0)
            slot, arrays = pool.get(seq)
            meta["bad_samples"] = pool.bad_samples
            return meta, arrays, lambda: pool.release(slot)

        self._prefetcher = Prefetcher(pull, device=self.device, rgb=self.rgb, depth=self.prefetch,
                                      timeout_s=self._pool_args["timeout_s"] * 2, **self._conv)

    def _make_pool(self) -> DecodePool:
        return DecodePool(self.index, self.layout, self.source_spec, **self._pool_args)

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

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": LOADER_STATE_VERSION, "seed": self.seed, "epoch": self.epoch,
                "consumed": self.consumed, "global_batch": self.global_batch, "steps_done": self.steps_done,
                "dropped": self.dropped, "shuffle_window": self.window, "num_samples": self.index.num_samples}

    def _check_state_version(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise CheckpointError(f"loader state version {state.get('version')!r}, this build reads "
                                  f"{LOADER_STATE_VERSION}; resume with the LoongForge that wrote it")

    def _state_keys(self) -> tuple:
        """(key, this run's value) that must equal the checkpoint's for the sample sequence to be the same."""
        return (("global_batch", self.global_batch), ("seed", self.seed), ("shuffle_window", self.window),
                ("num_samples", self.index.num_samples))

    def load_state_dict(self, state: dict) -> None:
        self._check_state_version(state)
        for key, mine in self._state_keys():
            # Another loader batch with the same optimizer-step batch (an elastic resume on fewer ranks: grad
            # accum absorbs them) reads the same global positions (_same_positions).
            if state[key] != mine and not (key == "global_batch" and self._same_positions(state)):
                raise CheckpointError(f"checkpoint has {key}={state[key]} but this run has {mine}: the sample "
                                      f"sequence would change; resume with the same {key}")
        self._stop_pipeline()
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.steps_done, self.dropped = int(state["steps_done"]), int(state["dropped"])
        self.steps_done = self.steps_done * int(state["global_batch"]) // self.global_batch

    def _same_positions(self, state: dict) -> bool:
        """Another loader batch (the same optimizer-step batch with another --grad-accum, e.g. an elastic
        resume on fewer ranks) reads the same global positions when the resume point is on a batch boundary
        and each epoch uses the same number of samples (same tail dropped)."""
        old, n = int(state["global_batch"]), self.plan.samples
        return int(state["consumed"]) % self.global_batch == 0 and n // old * old == n // self.global_batch * \
            self.global_batch

    def _stop_pipeline(self) -> None:
        # Order matters: wake the prefetch thread out of pool.get first, then join it, and only
        # then free the pool (its slots may be under the thread's copy until the join returns).
        if self._pool is not None:
            self._pool.interrupt()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._announcer is not None:
            close_source(self._announcer)
            self._announcer = None

    def close(self) -> None:
        self._stop_pipeline()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
