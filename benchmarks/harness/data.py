"""The benchmark's inputs: one generated LeRobot dataset and the shard root made from it.

Both loaders read the same dataset: the baseline reads the mp4 + parquet tree, LoongForge
reads the shard root `loongforge preprocess` made from it (frame blocks of `block_frames`,
what a user deploys). A sample is (episode, t) for every `stride`-th t, showing K frames at
video deltas -(K-1)..0 (clamped into the episode, as GR00T and LeRobot clamp) and the action
chunk t..t+H-1. The baseline's windows are those very samples, in sample-id order, taken from
the root's own episode table, so both loaders serve exactly the same (episode, t, frames).

For P1's GOP axis the same dataset is generated again at each other keyframe interval (same
seed: same episodes, lengths, pixels and parquet; only the H.264 keyframe spacing differs).
The shards are made once, from the `cfg.gop` dataset: a shard holds decoded frames, so the
source's GOP changes nothing LoongForge reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.dataset import DeltaSpec, SampleTable, open_root, sample_lengths, video_indices
from loongforge.benchmarks.loader.baseline import Window
from loongforge.shared.errors import ConfigError, LoongForgeError
from loongforge.shared.index import DatasetInfo
from loongforge.preprocess.samples.dataset import generate_dataset

log = logging.getLogger(__name__)
PREPROCESS_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Prepared:
    dataset: str  # LeRobot v2.x root (mp4 + parquet)
    shards: str  # the shard root preprocess made from it
    info: DatasetInfo  # the root's, with the loader's sample shape (K frames, H actions) filled in
    windows: tuple[Window, ...]  # sample id i as (episode, t, frames)
    source_frames: int  # video frames in the dataset, all cameras
    gop_datasets: dict  # keyframe interval -> LeRobot root encoded with it (cfg.gop -> `dataset`)
    generate_s: float
    transcode_s: float  # wall time of the whole `loongforge preprocess` job
    transcode_workers: int

    @property
    def num_samples(self) -> int:
        return len(self.windows)


def deltas_of(cfg: BenchConfig) -> DeltaSpec:
    """K = frames_per_sample frames per camera ending at t, and the action horizon."""
    k = cfg.frames_per_sample
    return DeltaSpec(video=tuple(range(1 - k, 1)), action_horizon=cfg.action_horizon)


def generate(cfg: BenchConfig, root: Path, gop: int | None = None) -> Path:
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


def preprocess_argv(cfg: BenchConfig, dataset: Path, out: Path) -> list[str]:
    """Every frame once, in blocks; the loader derives the K-frame samples from video deltas and stride."""
    return ["preprocess", "--input", str(dataset), "--output", str(out), "--block-frames", str(cfg.block_frames),
            "--action-horizon", str(cfg.action_horizon), "--height", str(cfg.height), "--width", str(cfg.width),
            "--workers", str(cfg.preprocess_workers), "--shard-size", cfg.shard_size]


def transcode(cfg: BenchConfig, dataset: Path, out: Path) -> float:
    """Run the real preprocess job as a user would (`loongforge preprocess ...`);
    returns its wall time, start-up included (what the one-off cost really is)."""
    argv = [sys.executable, "-m", "loongforge", *preprocess_argv(cfg, dataset, out)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PREPROCESS_TIMEOUT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        raise LoongForgeError(f"`loongforge preprocess` ran past {PREPROCESS_TIMEOUT_S}s") from exc
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise LoongForgeError("`loongforge preprocess` failed (exit %d):\n%s" % (proc.returncode, "\n".join(tail)))
    return seconds


def windows_of(root: str, deltas: DeltaSpec, stride: int) -> tuple[Window, ...]:
    """Sample id i of the root (stride, deltas) as the source episode, its t and the frames it shows."""
    ds = open_root(root)
    table = SampleTable(sample_lengths(ds.episode_lengths, deltas), stride=stride)  # the loader's samples
    out = []
    for i in range(table.num_samples):
        (e,), (t,) = table.locate([i])
        length = int(ds.episode_lengths[e])
        frames = tuple(int(f) for f in video_indices(int(t), length, deltas))
        out.append(Window(ds.episode_id(int(e)), int(t), frames))
    return tuple(out)


def sample_info(root: str, deltas: DeltaSpec) -> DatasetInfo:
    """The root's DatasetInfo with the loader's sample shape, as the trainer fills it in."""
    info = open_root(root).info
    return dataclasses.replace(info, frames_per_sample=deltas.frames, action_horizon=deltas.action_horizon)


def count_source_frames(dataset: Path, cameras: int) -> int:
    rows = [json.loads(x) for x in (dataset / "meta" / "episodes.jsonl").read_text().splitlines() if x.strip()]
    return sum(int(r["length"]) for r in rows) * cameras


def prepare(cfg: BenchConfig, workdir: Path) -> Prepared:
    workdir.mkdir(parents=True, exist_ok=True)
    dataset, shards = workdir / "lerobot", workdir / "shards"
    t0 = time.perf_counter()
    generate(cfg, dataset)
    generate_s = time.perf_counter() - t0
    log.info("generated %s in %.1fs; transcoding", dataset, generate_s)
    transcode_s = transcode(cfg, dataset, shards)
    windows = windows_of(str(shards), deltas_of(cfg), cfg.stride)
    if len(windows) < cfg.batch_size * 2:
        raise ConfigError(f"bench: the shards hold {len(windows)} samples, fewer than two batches of "
                          f"{cfg.batch_size}; generate more episodes or lower --batch-size")
    log.info("shards: %d samples of %d frames per camera, stride %d", len(windows), cfg.frames_per_sample,
             cfg.stride)
    gop_datasets = generate_gops(cfg, workdir, dataset)
    return Prepared(dataset=str(dataset), shards=str(shards), info=sample_info(str(shards), deltas_of(cfg)),
                    windows=windows, source_frames=count_source_frames(dataset, len(cfg.cameras)),
                    gop_datasets=gop_datasets, generate_s=generate_s, transcode_s=transcode_s,
                    transcode_workers=cfg.preprocess_workers)
