"""`loongforge convert ROOT --to v2 OUT`: rewrite a root of the retired format 1 as format 2.

This module is the only code that reads format 1 (FORMAT.md, appendix), and only
`loongforge convert` (preprocess/cli.py) imports it: the trainer, evaluation, the
cache and `inspect` read format 2 only (shared/dataset.py) and refuse a format-1
root with this command as the fix. Its reader is deliberately small: it reads
every shard whole once (size + sha256 checked), checks each sample's xxh3 where
the index has one, and parses each sample's tar members.

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
import json
import logging
from collections.abc import Iterator

import numpy as np
import xxhash

from loongforge.shared import paths, storage
from loongforge.shared.errors import FormatError, FormatVersionError, IntegrityError
from loongforge.shared.index import FORMAT_NAME, DatasetInfo, ShardEntry, ShardIndex, dataset_from_doc
from loongforge.shared.members import NV12_SUFFIX, decompress_into, load_npy, split_members
from loongforge.shared.source import OriginSource
from loongforge.shared.writer import DEFAULT_BLOCK_FRAMES, RootWriter

log = logging.getLogger(__name__)
LEGACY_VERSION = 1


@dataclasses.dataclass(slots=True)
class _Sample:
    """One v1 window, decoded."""

    key: str
    episode: int
    frame_indices: np.ndarray  # int64 (K,)
    timestamps: np.ndarray  # float64 (K,)
    frames: dict[str, np.ndarray]  # slot -> uint8 (K, 3h/2, w) NV12
    state: np.ndarray  # float32 (K, state_dim)
    action: np.ndarray  # float32 (H, action_dim): from the window's last frame on
    action_valid: int  # rows of `action` that are real
    task_index: int


class _Root:
    """A format-1 root: its index.json, then every sample in index order."""

    def __init__(self, root: str):
        path = paths.join(root, paths.INDEX_FILE)
        try:
            doc = json.loads(storage.read_bytes(path))
        except FileNotFoundError:
            raise FormatError(f"no {paths.INDEX_FILE} under {root!r}: not a shard root") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise FormatError(f"{path}: not a LoongForge shard index")
        if doc.get("format_version") != LEGACY_VERSION:
            raise FormatVersionError(f"{path}: format_version {doc.get('format_version')!r}: `loongforge convert` "
                                     f"reads format {LEGACY_VERSION} roots (a format-2 root needs no conversion)")
        try:
            self.dataset: DatasetInfo = dataset_from_doc(doc["dataset"])
            self.shards = [dict(s) for s in doc["shards"]]
            for s in self.shards:
                paths.check_relative(s["name"])
                if not len(s["keys"]) == len(s["offsets"]) == len(s["lengths"]):
                    raise FormatError(f"{path}: shard {s['name']}: per-sample lists differ in length")
                s["xxh3"] = (doc.get("sample_xxh3") or {}).get(s["name"], ())
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{path}: malformed format-1 index ({type(exc).__name__}: {exc})") from exc
        self.params = doc.get("params", {})
        self.failed = list(doc.get("failed", ()))
        self.val_episodes = tuple(int(e) for e in doc.get("split", {}).get("val_episodes", ()))
        self.num_samples = sum(len(s["keys"]) for s in self.shards)
        self.total_bytes = sum(int(s["bytes"]) for s in self.shards)
        index = ShardIndex(dataset=self.dataset, shards=tuple(ShardEntry(s["name"], int(s["bytes"]), s["sha256"])
                                                              for s in self.shards))
        self.source = OriginSource(root, index)

    def samples(self) -> Iterator[_Sample]:
        ds = self.dataset
        for s in self.shards:
            data = self.source.read_shard(s["name"])  # size + sha256 of the whole shard
            for i, (off, length) in enumerate(zip(s["offsets"], s["lengths"])):
                view = data[off : off + length]
                if s["xxh3"] and xxhash.xxh3_64_hexdigest(view) != s["xxh3"][i]:
                    raise IntegrityError(f"{s['name']}: sample {s['keys'][i]} does not match its xxh3: corrupt shard")
                yield _decode(view, ds.height, ds.width, ds.slots)


def _decode(view: memoryview, height: int, width: int, slots: list[str]) -> _Sample:
    members = split_members(view)
    key = next(iter(members)).partition(".")[0]
    by_ext = {}
    for name, data in members.items():
        k, _, ext = name.partition(".")
        if k != key:
            raise FormatError(f"sample fragment mixes keys {key!r} and {k!r}")
        by_ext[ext] = data
    try:
        meta = json.loads(bytes(by_ext["meta.json"]))
        if meta.get("format_version") != LEGACY_VERSION:
            raise FormatVersionError(f"sample {key!r}: format_version {meta.get('format_version')!r}, expected 1")
        k = int(meta["num_frames"])
        frames = {}
        for slot in slots:
            frames[slot] = np.empty((k, height * 3 // 2, width), np.uint8)
            decompress_into(by_ext[f"{slot}{NV12_SUFFIX}"], frames[slot])
        return _Sample(key=key, episode=int(meta["episode"]), frame_indices=np.asarray(meta["frames"], np.int64),
                       timestamps=np.asarray(meta["timestamps"], np.float64), frames=frames,
                       state=load_npy(by_ext["state.npy"], f"{key}.state.npy"),
                       action=load_npy(by_ext["action.npy"], f"{key}.action.npy"),
                       action_valid=int(meta["action_valid"]), task_index=int(meta.get("task_index", -1)))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"sample {key!r}: malformed ({type(exc).__name__}: {exc})") from exc


class _Episode:
    """One v1 episode being reassembled from its windows, frame by frame."""

    def __init__(self, episode: int, slots: list[str]):
        self.episode, self.slots = episode, slots
        self.frames: dict[int, dict[str, np.ndarray]] = {}
        self.state: dict[int, np.ndarray] = {}
        self.time: dict[int, float] = {}
        self.task: dict[int, int] = {}
        self.action: dict[int, np.ndarray] = {}

    def add(self, sample: _Sample) -> None:
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
            self.task[f] = sample.task_index
        last = int(sample.frame_indices[-1])
        for i in range(sample.action_valid):
            self.action.setdefault(last + i, sample.action[i])

    def arrays(self, strict: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        """(frames per slot, arrays, rows whose action was filled)."""
        t = max(self.frames) + 1
        missing = sorted(set(range(t)) - set(self.frames))
        if missing:
            raise FormatError(f"episode {self.episode}: frames {missing[:5]}{'...' if len(missing) > 5 else ''} are "
                              "in no v1 window (stride > frames per sample, or frame_step > 1): v2 needs every "
                              "frame; re-run `loongforge preprocess` from the source dataset")
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


def convert_root(src: str, dst: str, *, block_size: int = DEFAULT_BLOCK_FRAMES, zstd_level: int = 3,
                 shard_size: int = 64 << 20, strict: bool = False, block_codec: str = "zstd") -> dict:
    """Rewrite `src` (format 1) under `dst` (format 2); returns a summary. Reads every
    sample once, in index order (checksums verified), holding one episode at a time."""
    v1 = _Root(src)
    slots = v1.dataset.slots
    dataset = dataclasses.replace(v1.dataset, frames_per_sample=1)
    params = {"converted_from": {"format_version": LEGACY_VERSION, "params": v1.params}}
    writer = RootWriter(dst, dataset, block_size=block_size, zstd_level=zstd_level, shard_size=shard_size,
                        params=params, created_by="loongforge.convert v1->v2", block_codec=block_codec)
    done: set[int] = set()
    current: _Episode | None = None
    filled = samples = 0

    def flush(ep: _Episode) -> int:
        frames, arrays, n_filled = ep.arrays(strict)
        writer.add_episode(ep.episode, frames, arrays)
        done.add(ep.episode)
        return n_filled

    for sample in v1.samples():
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
    writer.close(val_episodes=v1.val_episodes, failed=v1.failed)
    if filled:
        log.warning("%d action rows were not in the v1 root and were filled from the next known row "
                    "(action_known marks them)", filled)
    frames = sum(lay.num_frames for lay in writer.layouts)
    return {"episodes": len(writer.layouts), "frames": frames, "v1_samples": samples, "actions_filled": filled,
            "v1_bytes": v1.total_bytes, "v2_bytes": sum(s["bytes"] for s in writer.shards),
            "block_size": block_size}
