"""BlockLoader: ShardLoader's API and batches over a format-2 shard root.

    loader = BlockLoader(root, batch_size=64, num_workers=4, deltas=DeltaSpec(video=(0,), action_horizon=16))
    for batch in loader: ...          # the same dict as ShardLoader's, plus nothing the model must learn
    loader.state_dict() / load_state_dict(...) / close()

What differs from v1 (loader.py): samples are (episode, t) derived from the memory-mapped
episode lengths (samples_v2.py), the order is block-aware (order_v2.py: runs of a block on
one rank, a bounded window, contiguous rank slices), and each decode worker opens the
dataset itself and keeps decoded blocks in a byte-bounded LRU (fill_v2.py). Frame counts
are fixed (K = len(video deltas)), so there is one bucket and frame_mask is all True;
action_valid flags the action rows past an episode's end (the loss ignores them).
`open_loader` picks the class from the root's format_version.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from loongforge.shared import paths
from loongforge.shared.errors import CheckpointError, ConfigError, FormatError
from loongforge.shared.storage import read_bytes
from loongforge.train.data import order_v1 as order, order as order_v2
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.fill import FillerSpec, dataset_info, open_dataset_v2
from loongforge.train.data.loader_v1 import ANNOUNCE_BATCHES, LOADER_STATE_VERSION, ShardLoader
from loongforge.train.data.prefetch import resolve_device
from loongforge.train.data.samples import DeltaSpec, SampleTable
from loongforge.train.data.sources import SourceSpec
from loongforge.train.data.workers import DecodePool

log = logging.getLogger(__name__)
DEFAULT_RUN = 4  # samples of one block kept together (measured: benchmarks/README.md, "v2 loader")
DEFAULT_WINDOW = 65536  # samples; the shuffle buffer of runs (benchmarks/README.md, "v2 loader")
DEFAULT_CACHE_MB = 256


def root_format_version(root: str) -> int:
    """format_version of the shard root's index.json (1 or 2), without parsing the rest."""
    try:
        doc = json.loads(read_bytes(paths.join(root, paths.INDEX_FILE)))
    except FileNotFoundError:
        raise FormatError(f"no {paths.INDEX_FILE} under {root!r}: not a shard root, or preprocess did not "
                          "finish. Run `loongforge preprocess --input DATASET --output ROOT`.") from None
    except ValueError as exc:
        raise FormatError(f"{root}/{paths.INDEX_FILE}: not valid JSON ({exc})") from exc
    version = doc.get("format_version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) else -1


def train_episodes(ds) -> np.ndarray | None:
    """Bool per episode (True = training) from the dataset's split; None when unsplit."""
    flags = ~np.asarray(ds.val_mask, bool)  # per episode row of the tables, memory-mapped ids
    return None if flags.all() else flags


class BlockLoader(ShardLoader):
    def __init__(self, root: str, *, batch_size: int, num_workers: int = 0, seed: int = 0, rank: int = 0,
                 world: int = 1, dataset=None, device: str | torch.device = "cpu", rgb: bool = True,
                 deltas: DeltaSpec = DeltaSpec(), stride: int = 1, block_run: int = DEFAULT_RUN,
                 block_window: int = DEFAULT_WINDOW, block_cache_mb: float = DEFAULT_CACHE_MB,
                 max_text_tokens: int = 32, bad_samples: str = "skip", prefetch: int = 2,
                 max_steps: int | None = None, timeout_s: float = 120.0, start_method: str = "spawn",
                 image_mean: float = 0.5, image_std: float = 0.25, train_only: bool = True,
                 source: SourceSpec | None = None):
        self.ds = dataset if dataset is not None else open_dataset_v2(root)
        info = dataset_info(self.ds)
        self.deltas, self.stride, self.run, self.window = deltas, stride, block_run, block_window
        self.table = SampleTable(np.asarray(self.ds.episode_lengths), stride=stride)
        # Per episode, not per sample: the order is built per (episode, block) group (order_v2.EpochOrder).
        self.train_eps = train_episodes(self.ds) if train_only else None
        self.block_size = int(self.ds.block_size)
        order_v2.block_sequence(np.zeros(1, np.int64), 0, 0, run=block_run, window=block_window)  # validate now
        self.index = self.ds.shard_index  # shards only (no samples): what the cache client needs
        self.source_spec = source or SourceSpec(root=root)
        self._episode_shard = np.asarray(self.ds.tables["episode_shard"])
        self._names = [s["name"] for s in self.ds.manifest["shards"]]
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = batch_size
        order.rank_positions(batch_size, rank, world)
        n = self.table.num_samples if self.train_eps is None else \
            int(self.table.counts[np.asarray(self.train_eps, bool)].sum())
        self.plan = order.plan_epoch(n, batch_size)
        self.layout = BatchLayout(batch_size // world, tuple(info.slots), info.height, info.width, deltas.frames,
                                  info.state_dim, info.action_dim, deltas.action_horizon, max_text_tokens)
        self.device = resolve_device(device)
        self.num_workers, self.prefetch, self.max_steps = num_workers, prefetch, max_steps
        if block_cache_mb < 0:
            raise ConfigError(f"data.block_cache_mb: {block_cache_mb}, must be >= 0 (0 = no cache)")
        self.filler_spec = FillerSpec(root, deltas, self.layout, int(block_cache_mb * (1 << 20)), self.source_spec)
        self._pool_args = dict(num_workers=num_workers, slots=max(2, num_workers * 2 + 1), policy=bad_samples,
                               timeout_s=timeout_s, start_method=start_method)
        self._conv = dict(matrix=info.color_matrix, color_range=info.color_range, mean=image_mean, std=image_std)
        self.rgb = rgb
        self.epoch, self.consumed, self.steps_done, self.dropped = 0, 0, 0, 0
        self._orders: dict[int, order_v2.EpochOrder] = {}  # this epoch and, near its end, the next
        self._pool = self._prefetcher = self._announcer = None
        self._announced_epoch, self._announced_next = -1, -1

    @property
    def num_samples(self) -> int:
        return self.table.num_samples

    def epoch_order(self, epoch: int) -> order_v2.EpochOrder:
        """The epoch's order, built per group; each rank expands only its own slices."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order_v2.EpochOrder(self.table, self.block_size, self.seed, epoch, run=self.run,
                                                      window=self.window, train_episodes=self.train_eps)
        return self._orders[epoch]

    def sequence(self, epoch: int) -> np.ndarray:
        """The whole epoch's sequence (O(samples): for analysis and tests, not the training path)."""
        seq_order = self.epoch_order(epoch)
        return seq_order.ids(0, seq_order.num_samples)

    def _plans(self):
        epoch, consumed, step = self.epoch, self.consumed, self.steps_done
        while self.max_steps is None or step < self.max_steps:
            ids = self.epoch_order(epoch).rank_ids(consumed, self.global_batch, self.rank, self.world)
            eps, ts = self.table.locate(ids)
            self._announce(epoch, consumed)
            items = list(zip(ids.tolist(), eps.tolist(), ts.tolist()))
            nxt_epoch, nxt_consumed = order.advance(epoch, consumed, self.plan)
            meta = {"epoch": epoch, "consumed": consumed, "step": step, "next_epoch": nxt_epoch,
                    "next_consumed": nxt_consumed, "sample_ids": ids.copy()}
            yield meta, self.deltas.frames, items
            epoch, consumed, step = nxt_epoch, nxt_consumed, step + 1

    def _announce(self, epoch, consumed) -> None:
        """v1's contract (loader.py): the rest of this epoch's shards once, the next epoch's
        near the end; here a shard is where the sample's episode lives."""
        if self._announcer is None:
            return
        end = self.plan.steps * self.global_batch
        if epoch != self._announced_epoch:
            if self._announced_next != epoch:
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

    def _make_pool(self) -> DecodePool:
        return DecodePool(None, self.layout, self.source_spec, filler_spec=self.filler_spec, **self._pool_args)

    def cache_counters(self) -> dict:
        """Block-cache hits/misses/evictions summed over the decode workers (as last reported)."""
        out: dict[str, int] = {}
        for c in (self._pool.worker_counters.values() if self._pool else ()):
            for key, v in c.items():
                out[key] = out.get(key, 0) + v
        return out

    def _order_key(self) -> dict:
        return {"stride": self.stride, "block_run": self.run, "block_window": self.window,
                "video_deltas": list(self.deltas.video), "block_size": int(self.ds.block_size)}

    def state_dict(self) -> dict:
        return {"version": LOADER_STATE_VERSION, "format_version": 2, "seed": self.seed, "epoch": self.epoch,
                "consumed": self.consumed, "global_batch": self.global_batch, "steps_done": self.steps_done,
                "dropped": self.dropped, "num_samples": self.num_samples, "order": self._order_key()}

    def _check_state_version(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION or state.get("format_version") != 2:
            raise CheckpointError(f"loader state version {state.get('version')!r} / format "
                                  f"{state.get('format_version', 1)!r}: this loader reads a format-2 state of "
                                  f"version {LOADER_STATE_VERSION}; resume on the shard root the run started on")

    def _state_keys(self) -> tuple:
        # rank slices and micro batches are both contiguous stretches of the order (order_v2), which does not
        # depend on the batch: ShardLoader.load_state_dict's batch-change rule holds here too
        return (("global_batch", self.global_batch), ("seed", self.seed), ("num_samples", self.num_samples),
                ("order", self._order_key()))

    def close(self) -> None:
        super().close()
        close = getattr(self.ds, "close", None)
        if callable(close):
            close()
