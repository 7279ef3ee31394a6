"""Filling one per-rank batch from a shard root, inside a decode worker.

The batch layout (batch.py): frames.<slot> (B, K, 3h/2, w) uint8 NV12 with K the number
of video delta indices, state (B, K, S) and action (B, H, A) as N1.6's processor makes them
(state_action.py: per modality key, relative actions, normalised), action_valid (B, H),
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
from loongforge.train.data.batch import BatchLayout, encode_text, fill_rows
from loongforge.train.data.block_cache import BlockCache
from loongforge.train.data.prompt import PromptTable
from loongforge.train.data.samples import DeltaSpec
from loongforge.train.data.sources import SourceSpec, make_source
from loongforge.train.data.state_action import EpisodeRows, StateAction, root_embodiment

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
    state_action: StateAction | None = None  # the embodiment's processor (None: the root's own, processor.py)
    keys: dict | None = None  # where its keys live in this root (shared/embodiment.key_layout)

    def open(self) -> "BlockFiller":
        factory = None
        if self.source is not None and self.source.wants_cache:
            spec = self.source
            factory = lambda shard_index: make_source(spec, shard_index)  # noqa: E731 - needs the shard list
        return BlockFiller(open_root(self.root, source=factory), self.deltas, self.layout, self.cache_bytes,
                           self.prompts, self.state_action, self.keys)


class BlockFiller:
    """Decodes samples (episode, t) into a batch's arrays: blocks through an LRU, arrays per episode."""

    def __init__(self, ds: Dataset, deltas: DeltaSpec, layout: BatchLayout, cache_bytes: int,
                 prompts: PromptTable | None = None, state_action: StateAction | None = None, keys: dict | None = None):
        self.ds, self.deltas, self.layout, self.prompts = ds, deltas, layout, prompts
        if prompts is not None and prompts.length != layout.text_len:
            raise ValueError(f"prompt table of {prompts.length} tokens, batch layout of {layout.text_len}")
        info = ds.info
        if state_action is None or keys is None:  # the root's own embodiment and statistics
            found = root_embodiment(info, self.ds)
            state_action, keys = StateAction(found.config, found.statistics, tag=found.tag), found.layout
        self.sa, self.keys = state_action, keys
        self.task_array = next(iter(keys["language"].values()), "task_index")
        self.tasks = {str(k): v for k, v in (info.tasks or {}).items()}
        self.cache = BlockCache(cache_bytes)
        self._arrays: OrderedDict[int, _Episode] = OrderedDict()
        self._prompt_rows: dict = {}  # task -> (ids, mask)
        self.block_size = int(ds.block_size)
        # a decoded block, full length, per camera
        self._block_shape = {s: (self.block_size, layout.size(i)[0] * 3 // 2, layout.size(i)[1])
                             for i, s in enumerate(layout.slots)}
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
            got = _Episode(self.ds.read_arrays(episode), int(self.ds.episode_lengths[episode]), episode, self.sa,
                           self.keys, self.task_array)
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
                                  lambda e=episode, s=slot, bb=b: read(e, s, bb, out=cache.spare(self._block_shape[s])))
                if i >= len(block):
                    raise FormatError(f"episode {episode}/{slot}: block {b} has {len(block)} frames, frame {f} needed")
                dst[k] = block[i]
        states = frames if self._state_is_video else \
            [0 if t + d < 0 else (last if t + d > last else t + d) for d in self._state]
        h = self.layout.horizon
        if t + h <= n:  # the whole chunk inside the episode (always, under N1.6's sampling)
            rows, zero = slice(t, t + h), None
            arrays["action_valid"][row] = True if ep.known is None else ep.known[t:t + h]
        else:  # a padding mode: rows past the end repeat the last row, or are zeros
            rows = [min(t + i, last) for i in range(h)]
            zero = slice(n - t, h) if self.deltas.action_pad == "zero" else None
            valid = arrays["action_valid"][row]
            valid[:n - t] = True if ep.known is None else ep.known[t:]
            valid[n - t:] = False
        ep.rows.fill(states, rows, zero, arrays["state"][row], arrays["action"][row])
        if "raw_state" in arrays:
            arrays["raw_state"][row] = ep.rows.raw_state_all[states]
            arrays["raw_action"][row] = ep.rows.raw_action_all[rows]
            if zero is not None:
                arrays["raw_action"][row][zero] = 0.0
        arrays["frame_mask"][row] = True
        ids, mask = self._tokens(ep.task(t))
        arrays["task_tokens"][row] = ids
        arrays["task_mask"][row] = mask


class _Episode:
    """One episode's arrays as a batch row needs them: N1.6's processing of its state and absolute action
    keys done once (state_action.EpisodeRows), checked against the index's length once."""

    __slots__ = ("length", "rows", "known", "_task")

    def __init__(self, arrays: dict, length: int, episode: int, sa: StateAction, keys: dict, task_array: str):
        self.length = length
        self.rows = EpisodeRows(sa, arrays, keys, length, episode)
        known = arrays.get("action_known")  # roots converted from format 1: rows whose action it never stored
        self.known = None if known is None else np.asarray(known, bool)
        self._task = arrays.get(task_array)

    def task(self, t: int) -> int | None:
        return None if self._task is None else int(self._task[min(t, self.length - 1)])
