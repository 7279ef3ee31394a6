"""The benchmark's inputs: one generated LeRobot dataset and its shards.

Both loaders read the same dataset: the baseline reads the mp4 + parquet tree,
LoongForge reads the shards `loongforge preprocess` made from it. The
baseline's windows are taken from the shards' own sample metadata, so both
loaders serve exactly the same (episode, frames) windows.

For P1's GOP axis the same dataset is generated again at each other keyframe
interval (same seed: same episodes, lengths, pixels and parquet; only the
H.264 keyframe spacing differs). LoongForge's shards are made once, from the
`cfg.gop` dataset: a shard holds decoded frames, so the source's GOP changes
nothing it reads.

Two roots of the same frames, each written by the real `loongforge preprocess`:
`shards_v2` in format 2 (the default a user deploys: frame blocks, B=16, zstd 3), whose
job is the P5 transcode cost and which P2-P5 read by default (`--format 1` pins them to
v1), and `shards` in format 1 (`--format-version 1`: K frames per sample), whose sample
metadata gives the baseline its windows and which P1's format-1 cells and the -v1
comparison cells read. BlockLoader reads format 2 with video deltas -(K-1)..0 and the
same stride: K frames per camera per sample, as many samples as format 1's windows
(± a tail window per episode). benchmarks/loader/block_loader.py and storage_v2.py measure v2 on
its own.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loongforge.benchmarks.loader.baseline import Window
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.shared.errors import ConfigError, LoongForgeError
from loongforge.shared.format import SampleParts
from loongforge.shared.index import ShardIndex, load_index
from loongforge.shared.source import OriginSource

log = logging.getLogger(__name__)
PREPROCESS_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Prepared:
    dataset: str  # LeRobot v2.x root (mp4 + parquet)
    shards: str  # shard root (index.json + shards/)
    index: ShardIndex
    windows: tuple[Window, ...]  # sample i of the index, as (episode, frames)
    source_frames: int  # video frames in the dataset, all cameras
    gop_datasets: dict  # keyframe interval -> LeRobot root encoded with it (cfg.gop -> `dataset`)
    generate_s: float
    transcode_s: float  # wall time of the whole format-1 `loongforge preprocess` job
    transcode_workers: int
    shards_v2: str | None = None  # format-2 root of the same frames (P2-P5 by default, P1's format-2 cells)
    transcode_v2_s: float = 0.0  # wall time of the format-2 job (the default a user runs): P5's subject

    def transcode_seconds(self, version: int) -> float:
        return self.transcode_v2_s if version == 2 else self.transcode_s


def generate(cfg: BenchConfig, root: Path, gop: int | None = None) -> Path:
    from loongforge.preprocess.sample_data import generate_dataset

    return Path(generate_dataset(root, episodes=cfg.episodes, frames=cfg.episode_frames, height=cfg.height,
                                 width=cfg.width, fps=cfg.fps, cameras=cfg.cameras, state_dim=cfg.state_dim,
                                 action_dim=cfg.action_dim, gop=cfg.gop if gop is None else gop, seed=cfg.seed))


def generate_gops(cfg: BenchConfig, workdir: Path, dataset: Path) -> dict[int, str]:
    """The main dataset re-encoded at every other GOP of the sweep; refuses a
    copy whose episodes differ (the windows would no longer be the same)."""
    out = {cfg.gop: str(dataset)}
    episodes = (dataset / "meta" / "episodes.jsonl").read_text()
    for gop in cfg.gops:
        if gop == cfg.gop:
            continue
        root = generate(cfg, workdir / f"lerobot-gop{gop}", gop)
        if (root / "meta" / "episodes.jsonl").read_text() != episodes:
            raise LoongForgeError(f"the GOP {gop} dataset has other episodes than the GOP {cfg.gop} one: "
                                  "sample_data.generate_dataset must not draw randomness per GOP")
        out[gop] = str(root)
    return out


def preprocess_argv(cfg: BenchConfig, dataset: Path, out: Path, version: int = 1) -> list[str]:
    """Format 1 writes K-frame windows every `stride` frames; format 2 writes every frame once
    (the loader derives the same K-frame samples from video deltas and stride)."""
    shape = ["--frames-per-sample", str(cfg.frames_per_sample), "--stride", str(cfg.stride)] if version == 1 \
        else ["--block-frames", str(cfg.block_frames)]
    return ["preprocess", "--input", str(dataset), "--output", str(out), "--format-version", str(version), *shape,
            "--action-horizon", str(cfg.action_horizon), "--height", str(cfg.height), "--width", str(cfg.width),
            "--workers", str(cfg.preprocess_workers), "--shard-size", cfg.shard_size]


def transcode(cfg: BenchConfig, dataset: Path, out: Path, version: int = 1) -> float:
    """Run the real preprocess job as a user would (`loongforge preprocess ...`);
    returns its wall time, start-up included (what the one-off cost really is)."""
    return _run_cli(preprocess_argv(cfg, dataset, out, version), f"preprocess (format {version})")


def _run_cli(args: list[str], what: str) -> float:
    argv = [sys.executable, "-m", "loongforge", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PREPROCESS_TIMEOUT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        raise LoongForgeError(f"`loongforge {what}` ran past {PREPROCESS_TIMEOUT_S}s") from exc
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise LoongForgeError("`loongforge %s` failed (exit %d):\n%s" % (what, proc.returncode, "\n".join(tail)))
    return seconds


def windows_of(root: str, index: ShardIndex) -> tuple[Window, ...]:
    source = OriginSource(root, index)
    out = []
    for entry in index.shards:
        for off, length in zip(entry.offsets, entry.lengths):
            meta = SampleParts(source.read_range(entry.name, off, length)).meta
            out.append(Window(int(meta["episode"]), tuple(int(f) for f in meta["frames"])))
    return tuple(out)


def count_source_frames(dataset: Path, cameras: int) -> int:
    import json

    rows = [json.loads(x) for x in (dataset / "meta" / "episodes.jsonl").read_text().splitlines() if x.strip()]
    return sum(int(r["length"]) for r in rows) * cameras


def prepare(cfg: BenchConfig, workdir: Path) -> Prepared:
    workdir.mkdir(parents=True, exist_ok=True)
    dataset, shards = workdir / "lerobot", workdir / "shards"
    t0 = time.perf_counter()
    generate(cfg, dataset)
    generate_s = time.perf_counter() - t0
    log.info("generated %s in %.1fs; transcoding", dataset, generate_s)
    transcode_v2_s = transcode(cfg, dataset, workdir / "shards_v2", 2)
    transcode_s = transcode(cfg, dataset, shards, 1)
    index = load_index(str(shards))
    if index.num_samples < cfg.batch_size * 2:
        raise ConfigError(f"bench: the shards hold {index.num_samples} samples, fewer than two batches of "
                          f"{cfg.batch_size}; generate more episodes or lower --batch-size")
    log.info("shards: %s", index.summary())
    gop_datasets = generate_gops(cfg, workdir, dataset)
    return Prepared(dataset=str(dataset), shards=str(shards), index=index, windows=windows_of(str(shards), index),
                    source_frames=count_source_frames(dataset, len(cfg.cameras)), gop_datasets=gop_datasets,
                    generate_s=generate_s, transcode_s=transcode_s, transcode_workers=cfg.preprocess_workers,
                    shards_v2=str(workdir / "shards_v2"), transcode_v2_s=transcode_v2_s)
