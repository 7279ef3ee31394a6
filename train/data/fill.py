"""Filling one per-rank batch from a shard root, inside a decode worker.

The batch layout (batch.py): frames.<slot> (B, K, 3h/2, w) uint8 NV12 with K the number
of video delta indices, state (B, K, S), action (B, H, A), action_valid (B, H),
frame_mask (B, K) all True (clamping always yields a frame), task tokens, sample_valid.

A worker opens the dataset itself (`open_root`: memory-mapped tables, nothing parsed per
worker), keeps decoded blocks in a byte-bounded LRU (block_cache.py) and the last few
episodes' arrays (a few KB each), and reports the cache counters with every batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from loongforge.shared.dataset import Dataset, open_root
from loongforge.shared.errors import FormatError
from loongforge.train.data.batch import BatchLayout, Norm, encode_text, fill_rows
from loongforge.train.data.block_cache import BlockCache
from loongforge.train.data.prompt import PromptTable
from loongforge.train.data.samples import DeltaSpec, action_rows, gather_actions, state_indices, video_indices
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
        self._arrays: OrderedDict[int, dict] = OrderedDict()
        self.samples = 0

    def counters(self) -> dict:
        return {**self.cache.counters(), "samples": self.samples}

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

        bad, reasons = fill_rows(arrays, items, policy, fill_row, lambda item: f"episode {item[1]}, t {item[2]}")
        self.samples += bad  # every row counts, a masked-out one too
        return bad, reasons

    def _episode(self, episode: int) -> dict:
        got = self._arrays.get(episode)
        if got is None:
            got = self.ds.read_arrays(episode)
            length = int(self.ds.episode_lengths[episode])
            for name in ("state", "action"):
                if got[name].shape[0] != length:
                    raise FormatError(f"episode {episode}: {name} has {got[name].shape[0]} rows, the index says "
                                      f"{length} frames")
            self._arrays[episode] = got
            if len(self._arrays) > EPISODE_ARRAYS_KEPT:
                self._arrays.popitem(last=False)
        else:
            self._arrays.move_to_end(episode)
        return got

    def _fill_row(self, arrays, row: int, episode: int, t: int) -> None:
        lay, spec = self.layout, self.deltas
        length = int(self.ds.episode_lengths[episode])
        frames = video_indices(t, length, spec)
        for slot in lay.slots:
            dst = arrays[f"frames.{slot}"][row]
            for k, f in enumerate(frames.tolist()):
                b, i = self.ds.block_of(f)
                block = self.cache.get((episode, slot, b), lambda e=episode, s=slot, bb=b: self.ds.read_block(e, s, bb))
                if i >= len(block):
                    raise FormatError(f"episode {episode}/{slot}: block {b} has {len(block)} frames, frame {f} needed")
                dst[k] = block[i]
        ep = self._episode(episode)
        state = ep["state"][state_indices(t, length, spec)]
        action, valid = gather_actions(ep["action"], t, spec)
        known = ep.get("action_known")  # roots converted from format 1: rows whose action it never stored
        if known is not None:
            valid &= np.asarray(known, bool)[action_rows(t, length, spec)[0]]
        if state.shape[1] != lay.state_dim or action.shape[1] != lay.action_dim:
            raise FormatError(f"episode {episode}: state {state.shape} / action {action.shape} do not match the "
                              f"index dims ({lay.state_dim}, {lay.action_dim})")
        arrays["state"][row] = self.norm.state(state)
        arrays["action"][row] = self.norm.action(action)
        arrays["action_valid"][row] = valid
        arrays["frame_mask"][row] = True
        task_index = ep.get("task_index")
        task = int(task_index[min(t, length - 1)]) if task_index is not None else None
        if self.prompts is not None:
            r = self.prompts.row(task)
            arrays["task_tokens"][row] = self.prompts.ids[r]
            arrays["task_mask"][row] = self.prompts.mask[r]
        else:
            ids, mask = encode_text(self.tasks.get(str(task), "") if task is not None else "", lay.text_len)
            arrays["task_tokens"][row] = ids
            arrays["task_mask"][row] = mask
