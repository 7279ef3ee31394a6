"""`BenchConfig`: every size and count the benchmark uses, in one validated place.

Two presets: the default (< 15 min on 2 cores) and `--quick` (< 2 min, what CI
runs). Each row of the result records the fields it used, so a figure can be
reproduced from its JSON alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from loongforge.shared.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    # -- the generated LeRobot dataset (fed to both loaders) -------------------
    episodes: int = 8
    episode_frames: tuple[int, int] = (300, 400)  # 15-20 s at 20 fps, like a real teleop episode
    height: int = 224  # GR00T-class models take 224x224 frames
    width: int = 224
    fps: int = 20
    cameras: tuple[str, ...] = ("ego_view", "wrist_view")
    gop: int = 250  # the dataset P2-P5 use and LoongForge's shards come from: the GR00T demo data's GOP
    # P1 sweeps the baseline over these keyframe intervals (same episodes, windows, workers, batch):
    # 2 is LeRobot's encoder default, 20 a tuned recording, ~250 what the GR00T demo data ships.
    gops: tuple[int, ...] = (2, 20, 250)
    state_dim: int = 8
    action_dim: int = 8
    # -- the samples (preprocess and loader parameters) --------------------------
    frames_per_sample: int = 4  # K: video deltas -(K-1)..0 per camera
    stride: int = 4  # a sample every `stride` timesteps
    action_horizon: int = 16
    shard_size: str = "64MB"  # the preprocess default
    preprocess_workers: int = 2
    block_frames: int = 16  # frames per zstd block (the preprocess default)
    # -- the loaders ------------------------------------------------------------
    pin_cores: bool = True  # P1: both loaders pinned to the same max(1, workers) cores (benchmarks/harness/cores.py)
    batch_size: int = 8
    workers: tuple[int, ...] = (0, 1, 2)
    repeats: int = 3
    baseline_batches: int = 12  # timed batches per baseline measurement (it is slow)
    ours_batches: int = 60  # timed batches per LoongForge measurement
    warmup_batches: int = 1  # not timed: worker start-up and first-touch costs
    train_steps: int = 12  # P3 timed steps per loader
    train_workers: int | None = None  # P3 loader workers; None = usable cores - 1 (a core for the model)
    ram_budget: str = "2GiB"
    seed: int = 0
    # -- which parts to run -----------------------------------------------------
    components: bool = True  # fold in benchmarks/loader/preprocess.py and benchmarks/loader/cache.py
    quick: bool = False

    def __post_init__(self):
        def need(ok: bool, name: str, fix: str):
            if not ok:
                raise ConfigError(f"bench.{name}: {fix}")

        need(self.episodes >= 1, "episodes", "must be >= 1")
        lo, hi = self.episode_frames
        need(2 <= lo <= hi, "episode_frames", "use (A, B) with 2 <= A <= B")
        need(self.gop >= 1, "gop", "must be >= 1")
        need(bool(self.gops) and all(g >= 1 for g in self.gops) and self.gop in self.gops, "gops",
             f"give keyframe intervals >= 1 that include gop={self.gop}, e.g. 2,20,{self.gop}")
        need(self.height % 2 == 0 and self.width % 2 == 0 and self.height > 0, "height",
             "NV12 needs positive even sizes")
        need(self.frames_per_sample >= 1 and self.stride >= 1, "frames_per_sample", "K and stride must be >= 1")
        need(lo >= self.frames_per_sample, "episode_frames", "episodes must hold at least one full window")
        need(self.batch_size >= 1, "batch_size", "must be >= 1")
        need(self.block_frames >= 1, "block_frames", "must be >= 1")
        need(bool(self.workers) and all(w >= 0 for w in self.workers), "workers", "give counts >= 0, e.g. 0,1,2")
        need(self.repeats >= 1, "repeats", "must be >= 1 (--repeats)")
        need(min(self.baseline_batches, self.ours_batches, self.train_steps) >= 1, "baseline_batches",
             "timed batch counts must be >= 1")
        need(self.train_workers is None or self.train_workers >= 0, "train_workers", "must be >= 0")
        need(self.warmup_batches >= 1, "warmup_batches", "must be >= 1 so worker start-up is never timed")

    @classmethod
    def quick_preset(cls, **overrides) -> "BenchConfig":
        # The long GOP stays >= 100 even here: it is what makes the baseline's seeks realistic.
        base = cls(episodes=2, episode_frames=(150, 180), height=64, width=64, gop=100, gops=(2, 20, 100), stride=4,
                   shard_size="1MB", batch_size=4, repeats=1, baseline_batches=2, ours_batches=10,
                   train_steps=4, quick=True)
        return replace(base, **overrides)

    def with_overrides(self, **overrides) -> "BenchConfig":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)
