"""The fault suite's data: its synthetic shard root, that root's global sample order (what
metrics.jsonl's sample ids are checked against), and the corrupt-shard-at-origin fault.

The root holds 12 episodes of 3-8 frames (blocks of 4 frames) in 6 shards of 2 episodes
(`make_synthetic_root`): 66 samples, so a global batch of 8 is 8 steps an epoch and a 10-step
run crosses an epoch boundary (the order is checked across it). The order is the trainer's
loader's own `epoch_order`, built with the trainer's defaults (DataConfig: block_run,
block_window, sample_stride).

Corrupt shard at origin: one byte flipped, in a copy of the root, before anything reads it,
inside one frame block of one camera of an episode in shard 1: every sample that SHOWS that
block (its video frames, after the episode-end clamp) is skipped by the bad-sample policy,
every other sample of the shard is delivered (the cache client's per-block reads, each
checked by xxh3).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness.dataset import (SampleTable, block_loader, make_synthetic_root, open_root,
                                                   sample_lengths, video_indices)
from loongforge.train.config import DataConfig
from loongforge.train.data.training_data import root_data
from loongforge.benchmarks.faults.env import Setup
from loongforge.benchmarks.faults.env import log_time

LENGTHS = (7, 4, 6, 5, 8, 3, 6, 5, 7, 4, 5, 6)  # 66 samples: 8 batches of 8 an epoch, 2 dropped (uneven tail)
# ~8 KB an episode here: 2 episodes a shard (a corrupt shard has a good neighbour), 6 shards, so each rank still
# maps a new shard at steps 5-7 (a daemon killed after step 2 is missed at the next such read; with 2 shards
# every shard was mapped by step 2 and the kill went unnoticed: nothing asked the daemon again).
SHARD_BYTES = 20000


def make_root(root: str) -> None:
    # one action row a sample: every frame is a sample under N1.6's sampling too (the counts above)
    make_synthetic_root(root, lengths=LENGTHS, shard_size=SHARD_BYTES, action_horizon=1)


def format_version(root: str) -> int:
    return int(open_root(root).manifest["format_version"])


def describe(root: str) -> str:
    """One line for the result JSON: what the runs trained on."""
    ds = open_root(root)
    lengths = list(map(int, ds.episode_lengths))
    return (f"format {ds.manifest['format_version']} synthetic root: {ds.num_episodes} episodes of {lengths} "
            f"frames, blocks of {ds.block_size} frames, {len(ds.manifest['shards'])} shards, cameras {list(ds.cameras)}")


def expected_order(root: str, steps: int, batch: int, seed: int = 1) -> list[list[int]]:
    """Per step 0..steps-1: the sorted sample ids of that global batch in the run's global order."""
    d = DataConfig(root=root)  # the trainer's defaults: the suite's runs pass none of these
    loader = block_loader(root, batch_size=batch, seed=seed, stride=d.sample_stride, block_run=d.block_run,
                          block_window=d.block_window, deltas=root_data(root, d).deltas)
    try:
        per_epoch = loader.plan.steps
        return [sorted(int(g) for g in loader.epoch_order(s // per_epoch).ids((s % per_epoch) * batch,
                                                                              (s % per_epoch + 1) * batch))
                for s in range(steps)]
    finally:
        loader.close()


def flip_byte(path: str, pos: int | None = None, mask: int = 0xFF) -> None:
    """XOR one byte of `path` (at `pos`, default the middle) with `mask`: the suite's and tests' corruption."""
    pos = os.path.getsize(path) // 2 if pos is None else pos
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def prepare_corrupt_shard(work: Path, root: str, name: str):
    copy = str(work / f"{name}-data")
    shutil.copytree(root, copy)
    info = _corrupt_block(copy)
    setup = Setup(copy)
    setup.info.update(info)
    return setup


def _corrupt_block(root: str) -> dict:
    """Block 1 of the last camera of the first episode of shard 1 (the second shard)."""
    ds = open_root(root)
    shard_of = np.asarray(ds.tables["episode_shard"])
    shard_no = 1 if shard_of.max() >= 1 else 0
    e = int(np.flatnonzero(shard_of == shard_no)[0])
    cam, b = ds.cameras[-1], 1 if ds.num_blocks(e) > 1 else 0
    shard, off, length, _, _ = ds.block_entry(e, cam, b)
    flip_byte(os.path.join(root, shard), off + length // 2)
    d = DataConfig(root=root)
    found = root_data(root, d)  # the trainer's sample shape (the root's modality config, N1.6's sampling)
    spec = found.deltas
    table = SampleTable(sample_lengths(ds.episode_lengths, spec), stride=d.sample_stride)
    length_e = int(ds.episode_lengths[e])
    show = [table.sample_id(e, t) for t in range(0, int(table.lengths[e]), d.sample_stride)
            if (video_indices(t, length_e, spec) // ds.block_size == b).any()]
    shard_ids = [int(i) for ep in np.flatnonzero(shard_of == shard_no)
                 for i in range(int(table.starts[ep]), int(table.ends[ep]))]
    return {"show_ids": show, "shard_ids": shard_ids,
            "corrupt_where": f"block {b} (frames {b * ds.block_size}-{min(length_e, (b + 1) * ds.block_size) - 1}) "
                             f"of camera {cam} of episode {ds.episode_id(e)} ({shard} byte {off + length // 2}); "
                             f"video deltas {tuple(spec.video)}: samples {_ranges(show)} show it"}


def f_corrupt_shard(run):
    run.wait_steps(1)
    return run.t0  # corrupted before the run started; detection is the first skip warning


SKIP_RE = re.compile(r"skipped bad sample \(data\.bad_samples='skip'\): sample (\d+) ")
# a rank's summary when its loader closes (train/data/workers.py BadSamples): count and every skipped id
SUMMARY_RE = re.compile(r"skipped (\d+) bad samples? from \S+ \(data\.bad_samples='skip'; sample ids ([\d, -]+)\)")


def _skipped(log: list[str]) -> tuple[list, set[int], int]:
    """(first-skip lines with their id, every skipped id, skip events) from the ranks' WARNINGs."""
    hits = [(ln, int(m.group(1))) for ln in log for m in [SKIP_RE.search(ln)] if m]
    ids, events = {gid for _, gid in hits}, 0
    for m in filter(None, map(SUMMARY_RE.search, log)):
        events += int(m.group(1))
        for part in m.group(2).split(", "):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
    return hits, ids, events or len(hits)


def annotate_corrupt_shard(row: dict, run, setup) -> None:
    log = Path(run.log.name).read_text(errors="replace").splitlines()
    hits, ids, events = _skipped(log)
    skipped = sorted(ids)
    if hits and (t := log_time(hits[0][0])) is not None:
        row["detected_after_s"] = round(t - row["t_inject"], 1)
    why = hits[0][0].split("): ", 1)[-1].split("; re-fetch")[0][:200] if hits else "no skip logged"
    # The samples that show the bad bytes AND were in a batch of this run (a sample of the epoch's dropped tail
    # never is): exactly those must be skipped. metrics.jsonl keeps a skipped row's id (sample_valid is False).
    trained = {i for r in run.rows() if "sample_ids" in r for ids in r["sample_ids"] for i in ids}
    want = sorted(set(setup.info["show_ids"]) & trained)
    shard = set(setup.info["shard_ids"]) & trained
    row["samples_skipped_by_policy"] = len(skipped)
    row["skipped_ids"], row["expected_skipped_ids"] = skipped, want
    row["skip_events"] = events  # a sample trained in two epochs is skipped twice
    per_member = any("one by one from origin" in ln for ln in log)  # the cache client's WARNING (cache/client.py)
    row["action"] = (f"1 byte flipped in {setup.info['corrupt_where']}, before launch; detected (s after launch) by "
                     f"{why}; "
                     + ("the daemon refused the shard (sha256), the client read its blocks one by one from origin, "
                        "each checked by xxh3; " if per_member else "")
                     + f"bad-sample policy skip (the default): {len(skipped)} sample(s) {_ranges(skipped)} masked "
                     f"out of their batches, the shard's other {len(shard - set(skipped))} trained delivered")
    # Recovered: every step trained and exactly the samples showing the corrupt bytes were skipped (not the shard).
    row["recovered"] = row["recovered"] and bool(want) and skipped == want


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2 else str(ids)
