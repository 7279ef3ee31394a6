"""Rewrite a format-1 root (per-sample windows) as format 2 (frames once, in blocks).

    loongforge convert OLD_ROOT --to v2 NEW_ROOT [--block-frames 16] [--strict]

v1 samples are windows that overlap, so a frame may be stored many times; the
converter keeps one copy per (episode, frame index) and checks the copies agree.
What v1 keeps is what v2 can get:

- frames and state: every frame some window holds. A frame no window holds
  (windows `stride` > K x frame_step apart leave gaps) cannot be recovered:
  the converter refuses and says to re-run preprocess from the source.
- actions: a v1 sample stores the H actions from its window's LAST frame on
  (`action_valid` real rows), so the actions of an episode's first K-1 frames
  (and any gap between chunks) are not in a v1 root. They are filled from the
  next known row and flagged in an extra `action_known` bool array (FORMAT.md),
  or refused with `--strict`.
- task_index per frame: the task of the window holding it (v1 records a task per
  window); timestamps: from the window metadata (v1 rounds them to 1 us).

Tail frames v1 dropped (shorter than `min_frames`) stay dropped.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from loongforge.shared.errors import FormatError, IntegrityError
from loongforge.shared.index import ShardIndex
from loongforge.shared.reader import ShardReader
from loongforge.shared.writer_v2 import DEFAULT_BLOCK_FRAMES, RootWriterV2

log = logging.getLogger(__name__)


class _Episode:
    """One v1 episode being reassembled from its windows, frame by frame."""

    def __init__(self, episode: int, slots: list[str]):
        self.episode, self.slots = episode, slots
        self.frames: dict[int, dict[str, np.ndarray]] = {}
        self.state: dict[int, np.ndarray] = {}
        self.time: dict[int, float] = {}
        self.task: dict[int, int] = {}
        self.action: dict[int, np.ndarray] = {}

    def add(self, sample) -> None:
        for j, f in enumerate(sample.frame_indices.tolist()):
            if f in self.frames:
                same = all(np.array_equal(self.frames[f][s], sample.frames[s][j]) for s in self.slots) and \
                    np.array_equal(self.state[f], sample.state[j])
                if not same:
                    raise IntegrityError(f"{sample.key}: frame {f} of episode {self.episode} differs between "
                                         "overlapping windows: the v1 root is inconsistent")
                continue
            self.frames[f] = {s: sample.frames[s][j] for s in self.slots}
            self.state[f] = sample.state[j]
            self.time[f] = float(sample.timestamps[j])
            self.task[f] = int(sample.task_index)
        last = int(sample.frame_indices[-1])
        for i in range(int(sample.action_valid)):
            self.action.setdefault(last + i, sample.action[i])

    def arrays(self, strict: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        """(frames per slot, arrays, rows whose action was filled)."""
        t = max(self.frames) + 1
        missing = sorted(set(range(t)) - set(self.frames))
        if missing:
            raise FormatError(f"episode {self.episode}: frames {missing[:5]}{'...' if len(missing) > 5 else ''} are "
                              "in no v1 window (stride > frames per sample, or frame_step > 1): v2 needs every "
                              "frame; re-run `loongforge preprocess --format-version 2` from the source dataset")
        known = np.array([f in self.action for f in range(t)])
        if not known.any():
            raise FormatError(f"episode {self.episode}: no action rows in the v1 root")
        if strict and not known.all():
            raise FormatError(f"episode {self.episode}: actions of frames {np.flatnonzero(~known)[:5].tolist()} are "
                              "not stored in the v1 root (a window stores actions from its last frame on); drop "
                              "--strict to fill them (flagged in action_known) or re-run preprocess from the source")
        order = np.arange(t)
        # backfill: row f takes the next known row (the last known one past the end)
        nxt = np.minimum.accumulate(np.where(known, order, t)[::-1])[::-1]
        src = np.where(nxt < t, nxt, np.flatnonzero(known)[-1])
        action = np.stack([self.action[int(s)] for s in src])
        frames = {s: np.stack([self.frames[f][s] for f in range(t)]) for s in self.slots}
        arrays = {"state": np.stack([self.state[f] for f in range(t)]), "action": action,
                  "timestamp": np.array([self.time[f] for f in range(t)], np.float64),
                  "frame_index": order.astype(np.int64),
                  "task_index": np.array([self.task[f] for f in range(t)], np.int64)}
        if not known.all():
            arrays["action_known"] = known
        return frames, arrays, int((~known).sum())


def convert_v1_to_v2(src: str, dst: str, *, block_size: int = DEFAULT_BLOCK_FRAMES, zstd_level: int = 3,
                     shard_size: int = 64 << 20, strict: bool = False, block_codec: str = "zstd") -> dict:
    """Rewrite `src` (format 1) under `dst` (format 2); returns a summary. Reads every
    sample once, in index order (checksums verified), holding one episode at a time."""
    reader = ShardReader(src)
    index: ShardIndex = reader.index
    slots = index.dataset.slots
    dataset = dataclasses.replace(index.dataset, frames_per_sample=1)
    params = {"converted_from": {"format_version": 1, "params": index.params}}
    writer = RootWriterV2(dst, dataset, block_size=block_size, zstd_level=zstd_level, shard_size=shard_size,
                          params=params, created_by="loongforge.convert v1->v2", block_codec=block_codec)
    done: set[int] = set()
    current: _Episode | None = None
    filled = samples = 0

    def flush(ep: _Episode) -> int:
        frames, arrays, n_filled = ep.arrays(strict)
        writer.add_episode(ep.episode, frames, arrays)
        done.add(ep.episode)
        return n_filled

    for sample in reader:
        samples += 1
        if current is None or sample.episode != current.episode:
            if current is not None:
                filled += flush(current)
            if sample.episode in done:
                raise FormatError(f"episode {sample.episode} appears twice, apart, in {src}: v1 roots written by "
                                  "preprocess keep an episode's samples together")
            current = _Episode(sample.episode, slots)
        current.add(sample)
    if current is not None:
        filled += flush(current)
    writer.close(val_episodes=index.val_episodes, failed=list(index.failed))
    if filled:
        log.warning("%d action rows were not in the v1 root and were filled from the next known row "
                    "(action_known marks them)", filled)
    frames = sum(lay.num_frames for lay in writer.layouts)
    return {"episodes": len(writer.layouts), "frames": frames, "v1_samples": samples, "actions_filled": filled,
            "v1_bytes": index.total_bytes, "v2_bytes": sum(s["bytes"] for s in writer.shards),
            "block_size": block_size}
