"""Filling one per-rank batch from a shard root, inside a decode worker.

The batch layout (batch.py): frames.<slot> (B, K, 3h/2, w) uint8 NV12 with K the number
of video delta indices, state (B, K, S), action (B, H, A), action_valid (B, H),
frame_mask (B, K) all True (clamping always yields a frame), task tokens, sample_valid.

A worker opens the dataset itself (`open_root`: memory-mapped tables, nothing parsed per
worker), keeps decoded blocks in a byte-bounded LRU (block_cache.py) and the last few
episodes' arrays (a few KB each), and reports the cache counters with every batch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.errors import FormatError
from loongforge.train.data.batch import BatchLayout, Norm, encode_text, fill_rows
from loongforge.train.data.block_cache import BlockCache
from loongforge.train.data.prompt import PromptTable
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.data.sources import SourceSpec, make_source

EPISODE_ARRAYS_KEPT = 64  # episodes whose arrays a worker keeps: a window touches few, each is small


@dataclass(frozen=True, slots=True)
class FillerSpec:
    """Everything a worker needs to build its BlockFiller; picklable (spawned workers)."""

    root: str
    deltas: DeltaSpec
    layout: BatchLayout
    cache_bytes: int
    source: SourceSpec | None = None  # the cache daemon's client when set (shard-level reads)
    prompts: PromptTable | None = None  # the model's prompt per task (prompt.py); None = the task's bytes

    def open(self) -> "BlockFiller":
        factory = None
        if self.source is not None and self.source.wants_cache:
            spec = self.source
            factory = lambda shard_index: make_source(spec, shard_index)  # noqa: E731 - needs the shard list
        return BlockFiller(open_root(self.root, source=factory), self.deltas, self.layout, self.cache_bytes,
                           self.prompts)


class BlockFiller:
    """Decodes samples (episode, t) into a batch's arrays: blocks through an LRU, arrays per episode."""

    def __init__(self, ds: Dataset, deltas: DeltaSpec, layout: BatchLayout, cache_bytes: int,
                 prompts: PromptTable | None = None):
        self.ds, self.deltas, self.layout, self.prompts = ds, deltas, layout, prompts
        if prompts is not None and prompts.length != layout.text_len:
            raise ValueError(f"prompt table of {prompts.length} tokens, batch layout of {layout.text_len}")
        info = ds.info
        self.norm = Norm.from_dataset(info)
        self.tasks = {str(k): v for k, v in (info.tasks or {}).items()}
        self.cache = BlockCache(cache_bytes)
        self._arrays: OrderedDict[int, _Episode] = OrderedDict()
        self._prompt_rows: dict = {}  # task -> (ids, mask)
        self.block_size = int(ds.block_size)
        self._block_shape = (self.block_size, layout.height * 3 // 2, layout.width)  # a decoded block, full length
        self._video = tuple(int(d) for d in deltas.video)
        self._state = tuple(int(d) for d in deltas.state_deltas)
        self._state_is_video = self._state == self._video
        self.samples = 0
        self.fill_cpu_s = 0.0  # CPU seconds of this thread in fill(): the benchmark's account of where time goes

    def counters(self) -> dict:
        return {**self.cache.counters(), "samples": self.samples, "fill_cpu_s": self.fill_cpu_s}

    def close(self) -> None:
        self.cache.clear()
        close = getattr(self.ds, "close", None)
        if callable(close):
            close()

    def fill(self, arrays: dict[str, np.ndarray], items, policy: str) -> tuple[int, list[str]]:
        """Decode items = [(sample id, episode, t)] into `arrays` (batch.fill_rows: bad rows
        are kept, masked out and counted under 'skip'; 'raise' stops at the first)."""
        def fill_row(row, item):
            self._fill_row(arrays, row, int(item[1]), int(item[2]))
            self.samples += 1

        c0 = time.thread_time()
        try:
            bad, reasons = fill_rows(arrays, items, policy, fill_row, lambda item: f"episode {item[1]}, t {item[2]}")
        finally:
            self.fill_cpu_s += time.thread_time() - c0
        self.samples += bad  # every row counts, a masked-out one too
        return bad, reasons

    def _episode(self, episode: int) -> "_Episode":
        got = self._arrays.get(episode)
        if got is None:
            got = _Episode(self.ds.read_arrays(episode), int(self.ds.episode_lengths[episode]), episode, self.layout,
                           self.norm, self.deltas)
            self._arrays[episode] = got
            if len(self._arrays) > EPISODE_ARRAYS_KEPT:
                self._arrays.popitem(last=False)
        else:
            self._arrays.move_to_end(episode)
        return got

    def _tokens(self, task: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of a task's prompt, made once per task (a batch row copies them)."""
        got = self._prompt_rows.get(task)
        if got is None:
            if self.prompts is not None:
                r = self.prompts.row(task)
                got = (self.prompts.ids[r], self.prompts.mask[r])
            else:
                got = encode_text(self.tasks.get(str(task), "") if task is not None else "", self.layout.text_len)
            self._prompt_rows[task] = got
        return got

    def _fill_row(self, arrays, row: int, episode: int, t: int) -> None:
        # Per row: plain-int index arithmetic and one numpy copy per field. The episode's arrays were
        # normalized once when it was read (_Episode), so a row is slices of them (samples.py's semantics).
        ep = self._episode(episode)
        n, bs, cache, read = ep.length, self.block_size, self.cache, self.ds.read_block
        last = n - 1
        frames = [0 if t + d < 0 else (last if t + d > last else t + d) for d in self._video]
        for slot in self.layout.slots:
            dst = arrays[f"frames.{slot}"][row]
            for k, f in enumerate(frames):
                b, i = divmod(f, bs)
                block = cache.get((episode, slot, b),
                                  lambda e=episode, s=slot, bb=b: read(e, s, bb, out=cache.spare(self._block_shape)))
                if i >= len(block):
                    raise FormatError(f"episode {episode}/{slot}: block {b} has {len(block)} frames, frame {f} needed")
                dst[k] = block[i]
        if self._state_is_video:
            arrays["state"][row] = ep.state[frames]
        else:
            arrays["state"][row] = ep.state[[0 if t + d < 0 else (last if t + d > last else t + d)
                                             for d in self._state]]
        h = self.layout.horizon
        if t + h <= n:  # the whole chunk inside the episode: one slice
            arrays["action"][row] = ep.action[t:t + h]
            arrays["action_valid"][row] = True if ep.known is None else ep.known[t:t + h]
        else:
            inside = n - t
            out, valid = arrays["action"][row], arrays["action_valid"][row]
            out[:inside] = ep.action[t:]
            out[inside:] = ep.action[last] if ep.pad is None else ep.pad
            valid[:inside] = True if ep.known is None else ep.known[t:]
            valid[inside:] = False
        arrays["frame_mask"][row] = True
        ids, mask = self._tokens(ep.task(t))
        arrays["task_tokens"][row] = ids
        arrays["task_mask"][row] = mask


class _Episode:
    """One episode's arrays as a batch row needs them: state and action normalized once (Norm is
    elementwise, so normalizing the episode then slicing equals slicing then normalizing), checked
    against the index's length and the layout's dims once, the action pad row for action_pad="zero"."""

    __slots__ = ("length", "state", "action", "known", "pad", "_task")

    def __init__(self, arrays: dict, length: int, episode: int, layout: BatchLayout, norm: Norm, deltas: DeltaSpec):
        for name in ("state", "action"):
            if arrays[name].shape[0] != length:
                raise FormatError(f"episode {episode}: {name} has {arrays[name].shape[0]} rows, the index says "
                                  f"{length} frames")
        state, action = arrays["state"], arrays["action"]
        if state.ndim != 2 or action.ndim != 2 or state.shape[1] != layout.state_dim or \
                action.shape[1] != layout.action_dim:
            raise FormatError(f"episode {episode}: state {state.shape[1:]} / action {action.shape[1:]} do not match "
                              f"the index dims ({layout.state_dim}, {layout.action_dim})")
        self.length = length
        self.state = np.ascontiguousarray(norm.state(state))
        self.action = np.ascontiguousarray(norm.action(action))
        # action_pad="zero": the raw rows past the end are zeros, normalized as every other row (samples.py)
        self.pad = norm.action(np.zeros(layout.action_dim, np.float32)) if deltas.action_pad == "zero" else None
        known = arrays.get("action_known")  # roots converted from format 1: rows whose action it never stored
        self.known = None if known is None else np.asarray(known, bool)
        self._task = arrays.get("task_index")

    def task(self, t: int) -> int | None:
        return None if self._task is None else int(self._task[min(t, self.length - 1)])
