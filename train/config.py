"""Typed configs of the trainer, one frozen dataclass per component.

Every value is checked in `__post_init__`; a bad one raises `ConfigError`
naming the field and the fix, so a launch fails before any process group or
worker exists. The DeepSpeed JSON is generated from these (engine.py), never
written by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loongforge.shared.errors import ConfigError

BAD_SAMPLE_POLICIES = ("skip", "raise")
TAIL_POLICIES = ("drop",)  # see order.py: padding would duplicate samples within an epoch
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flash")  # train/model/attention.py
LR_SCHEDULES = ("cosine", "linear", "constant")
# Peak learning rate per recipe (OptimConfig.lr unless --lr), for the default warm-up + cosine schedule.
# gr00t-n1.6: Isaac-GR00T's fine-tuning lr. tiny / small: train/README.md has the figures.
RECIPE_LR = {"tiny": 1e-3, "tiny-sim": 1e-3, "small": 3e-4, "gr00t-n1.6": 1e-4}
REPORT_TO = ("tensorboard", "wandb")  # experiment trackers (train/observe/tracking.py), HF Trainer's names


def _need(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    root: str  # the (first) shard root
    # Several roots mixed by ratio (train/data/mixture.py): ((root, ratio), ...), the first being `root`;
    # () = `root` alone
    mixture: tuple[tuple[str, float], ...] = ()
    global_batch_size: int = 8  # samples per optimizer step over all ranks (micro batch x world x accum)
    num_workers: int = 0
    seed: int = 0
    bad_samples: str = "skip"
    prefetch_batches: int = 2  # batches in flight per worker
    worker_timeout_s: float = 120.0  # no result for this long = a stuck worker, raise
    start_method: str = "spawn"  # workers never inherit the trainer's threads or CUDA context
    cache_socket: str | None = None
    cache_tcp: str | None = None
    # Samples are (episode, t) (train/data/samples.py), in a block-aware order (train/data/order.py).
    # Delta indices: () / 0 = the root's modality config (recorded by preprocess); flags override them
    video_deltas: tuple[int, ...] = ()  # frame offsets around t (N1.6: 0; history e.g. -6,-4,-2,0)
    state_deltas: tuple[int, ...] = ()  # () = the video offsets
    action_horizon: int = 0  # H action rows from t; 0 = the modality config's
    # "none": a sample only where its whole chunk lies in the episode (N1.6); "last" / "zero": every timestep,
    # the chunk past the end padded (and masked out of the loss)
    action_pad: str = "none"
    sample_stride: int = 1  # every s-th timestep is a sample (GR00T: 1)
    block_run: int = 4  # samples of one frame block kept together in the order (decodes vs diversity)
    block_window: int = 65536  # samples; shuffle buffer of those runs
    block_cache_mb: float = 256.0  # decoded-block LRU per decode worker

    def __post_init__(self):
        _need(bool(self.root), "data.root", "give the shard root (directory holding index.json)")
        _need(not self.mixture or (self.mixture[0][0] == self.root and all(r > 0 for _, r in self.mixture)),
              "data.mixture", "the first root is data.root and every ratio is > 0 (--data ROOT:RATIO)")
        _need(len({r for r, _ in self.mixture}) == len(self.mixture), "data.mixture", "a root is given twice")
        _need(self.sample_stride >= 1, "data.sample_stride", "must be >= 1")
        _need(self.block_run >= 1 and self.block_window >= 1, "data.block_run", "block_run and block_window must be >= 1")
        _need(self.block_cache_mb >= 0, "data.block_cache_mb", "must be >= 0 (0 = no block cache)")
        _need(self.action_horizon >= 0, "data.action_horizon", "must be >= 0 (0 = the index's)")
        _need(self.global_batch_size >= 1, "data.global_batch_size", "must be >= 1")
        _need(self.num_workers >= 0, "data.num_workers", "must be >= 0 (0 decodes in the main process)")
        _need(self.bad_samples in BAD_SAMPLE_POLICIES, "data.bad_samples", f"use one of {BAD_SAMPLE_POLICIES}")
        _need(self.prefetch_batches >= 1, "data.prefetch_batches", "must be >= 1")
        _need(self.worker_timeout_s > 0, "data.worker_timeout_s", "must be > 0")
        _need(self.start_method in ("spawn", "forkserver", "fork"), "data.start_method",
              "use spawn, forkserver or fork")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """What the user chooses about the model. The architecture itself (GR00T N1.6 at a recipe's size,
    or the --init-from checkpoint's) is decided in train/recipes.py; a tune_* left None keeps the
    recipe's or the checkpoint's switch."""

    attention: str = "auto"  # auto | sdpa | flex | flash: train/model/attention.py (auto = sdpa on CPU)
    init_from: str | None = None  # an Isaac-GR00T N1.6 checkpoint directory (config.json + model*.safetensors)
    tokenizer: str | None = None  # directory of the tokenizer files; default: init_from's, else bytes
    embodiment_tag: str | None = None  # a check: the tag the data was preprocessed with (it decides)
    tune_llm: bool | None = None
    tune_visual: bool | None = None
    tune_top_llm_layers: int | None = None
    tune_projector: bool | None = None
    tune_diffusion_model: bool | None = None
    tune_vlln: bool | None = None
    dit_dropout: float | None = None  # None = the architecture's (N1.6: 0.2)
    state_dropout: float | None = None  # N1.6's state_dropout_prob; None = the model's (0)
    color_jitter: tuple[float, ...] | None = None  # brightness, contrast, saturation, hue; None = the recipe's;
    # () = no colour jitter
    override_statistics: bool = False  # --init-from: the data's statistics even for the checkpoint's own tags

    def __post_init__(self):
        _need(self.attention in ATTENTION_BACKENDS, "model.attention", f"use one of {ATTENTION_BACKENDS}")
        _need(self.tune_top_llm_layers is None or self.tune_top_llm_layers >= 0, "model.tune_top_llm_layers",
              "must be >= 0")
        _need(self.dit_dropout is None or 0.0 <= self.dit_dropout < 1.0, "model.dit_dropout", "must be in [0, 1)")
        _need(self.state_dropout is None or 0.0 <= self.state_dropout < 1.0, "model.state_dropout",
              "must be in [0, 1)")
        _need(self.color_jitter is None or len(self.color_jitter) in (0, 4), "model.color_jitter",
              "four values (brightness,contrast,saturation,hue) or none")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW (decoupled weight decay) under a warm-up + decay schedule (train/parallel/lr_schedule.py).
    Defaults follow GR00T's fine-tuning (warm-up ratio 0.05, cosine to 0, weight decay 1e-5, clip 1.0);
    the peak lr is the recipe's (RECIPE_LR) unless --lr is given."""

    lr: float = RECIPE_LR["tiny"]  # peak learning rate (the default recipe's)
    weight_decay: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    lr_schedule: str = "cosine"  # cosine | linear (decay to min_lr_ratio at the last step) | constant
    warmup_steps: int | None = None  # linear warm-up updates; None = warmup_ratio of the run's steps
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0  # lr at the end of the decay, as a fraction of the peak
    grad_clip: float = 1.0  # global gradient-norm clipping; 0 disables it

    def __post_init__(self):
        _need(self.lr > 0, "optim.lr", "must be > 0")
        _need(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _need(self.lr_schedule in LR_SCHEDULES, "optim.lr_schedule", f"use one of {LR_SCHEDULES} (--lr-schedule)")
        _need(self.warmup_steps is None or self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _need(0.0 <= self.warmup_ratio < 1.0, "optim.warmup_ratio", "must be in [0, 1) (--warmup-ratio)")
        _need(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        _need(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up updates of a run of `total_steps` optimizer steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    zero_stage: int = 2
    grad_accum: int = 1
    reduce_bucket_size: int = 50_000_000
    overlap_comm: bool = True
    zero3_leaf_blocks: bool = False  # ZeRO-3: trunk/head blocks are DeepSpeed leaf modules (one fetch per block)
    precision: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    # DeepSpeed's own fwd/bwd/allreduce timers: three console lines per step, and metrics.jsonl has ours
    wall_clock_breakdown: bool = False
    dist_timeout_s: float = 600.0  # a collective waiting on a dead peer fails after this, never hangs
    tp: int = 1  # tensor-parallel degree (train/parallel/): DP = world / (tp * sp)
    sp: int = 1  # sequence-parallel degree over the video tokens (train/parallel/video_sp.py)
    # "topk": hybrid sharding, ZeRO-3 inside the SP group and top-k + error feedback across DP replicas
    # (train/parallel/README.md); compress_ratio = dense all-reduce bytes / bytes sent (3 = the seed's 3:1).
    grad_compression: str = "none"
    compress_ratio: float = 3.0
    compress_warmup_steps: int = 0  # topk: the first N optimizer steps sync dense (README: convergence)

    def __post_init__(self):
        _need(self.dist_timeout_s > 0, "parallel.dist_timeout_s", "must be > 0")
        _need(self.tp >= 1, "parallel.tp", "must be >= 1 (--tp)")
        _need(self.sp >= 1, "parallel.sp", "must be >= 1 (--sp)")
        _need(self.grad_compression in ("none", "topk"), "parallel.grad_compression", "use none or topk")
        _need(self.compress_ratio >= 1.0, "parallel.compress_ratio", "must be >= 1 (dense bytes / bytes sent)")
        _need(self.compress_warmup_steps >= 0, "parallel.compress_warmup_steps", "must be >= 0")
        _need(self.compress_warmup_steps == 0 or self.grad_compression == "topk", "parallel.compress_warmup_steps",
              "dense warm-up steps of top-k compression: add --grad-compression topk")
        _need(self.grad_compression == "none" or self.zero_stage == 3, "parallel.grad_compression",
              "topk runs in hybrid sharding, which is ZeRO-3 inside the shard group: add --zero 3")
        _need(self.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", "use 0, 1, 2 or 3 (--zero)")
        _need(self.grad_accum >= 1, "parallel.grad_accum", "must be >= 1")
        _need(self.reduce_bucket_size >= 1, "parallel.reduce_bucket_size", "must be >= 1")
        _need(self.precision in ("auto", "bf16", "fp32"), "parallel.precision", "use auto, bf16 or fp32")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Applied from outside the model by policies.apply_memory_policies (memory.py, precision.py)."""

    ac_every: int = 0  # checkpoint blocks 0, N, 2N, ... of each block list; 0 = off (`loongforge tune ac`)
    fp8: bool = False  # torchao Float8Linear for inner-block GEMMs (CUDA capability >= 8.9)
    fp8_warmup_steps: int = 0  # blend high precision -> FP8 over this many steps from the (re)start
    fp8_warmup_mode: str = "blend"  # blend | switch
    fp8_recipe: str = "tensorwise"  # torchao recipe: tensorwise | rowwise | rowwise_with_gw_hp
    fp8_min_features: int = 256  # GEMMs with a smaller in/out dim stay in high precision
    fuse: str = "auto"  # torch.compile of block forwards (fusion.py): auto = CUDA with ZeRO < 3 | on | off
    cuda_graphs: bool = False  # CUDA graph trees over the block forwards (graphs.py); CUDA, ZeRO < 3, no AC

    def __post_init__(self):
        _need(self.ac_every >= 0, "memory.ac_every", "must be >= 0 (0 = off); see `loongforge tune ac`")
        _need(self.fp8_warmup_steps >= 0, "memory.fp8_warmup_steps", "must be >= 0")
        _need(self.fp8_warmup_mode in ("blend", "switch"), "memory.fp8_warmup_mode", "use blend or switch")
        _need(self.fp8_recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"), "memory.fp8_recipe",
              "use tensorwise, rowwise or rowwise_with_gw_hp")
        _need(self.fp8_min_features >= 16, "memory.fp8_min_features", "must be >= 16")
        _need(self.fuse in ("auto", "on", "off"), "memory.fuse", "use auto, on or off")
        _need(not (self.cuda_graphs and self.ac_every), "memory.cuda_graphs",
              "--cuda-graphs does not compose with --ac-every (the recompute re-runs the graphed forward inside "
              "the backward); use --ac-every 0 or drop --cuda-graphs")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    run_dir: str
    steps: int = 10
    save_every: int = 0  # 0 = only at the end
    resume: bool = False
    overwrite: bool = False  # a fresh run on a run dir holding checkpoints: move them aside (resilience/rundir.py)
    log_every: int = 1
    profile_steps: tuple[int, int] | None = None  # [a, b) steps traced with torch.profiler
    device: str = "auto"  # auto = cuda if available else cpu
    eval_every: int = 0  # validation flow loss + action MSE every N steps (needs a split); 0 = never
    eval_samples: int = 32  # the fixed, evenly spaced validation subset it scores
    save_async: bool = True  # snapshot to host memory, write in a background thread (checkpoint.py)
    save_busy: str = "wait"  # a save requested while the previous one is still writing: wait for it, or skip
    keep_last: int = 0  # published checkpoints kept (0 = all); older ones go after a newer one is published
    save_mbps: float = 0.0  # write-rate cap of the checkpoint writer in MB/s (0 = none)
    full_every: int = 0  # a full checkpoint every N saves, XOR+zstd deltas between (0 or 1 = always full)
    delta_max_ratio: float = 0.5  # a delta above this fraction of a full save is written full instead

    def __post_init__(self):
        _need(bool(self.run_dir), "run.run_dir", "give --run-dir")
        _need(not (self.resume and self.overwrite), "run.overwrite", "give --resume or --overwrite, not both")
        _need(self.save_busy in ("wait", "skip"), "run.save_busy", "use wait or skip (--save-busy)")
        _need(self.keep_last >= 0, "run.keep_last", "must be >= 0 (0 keeps every checkpoint)")
        _need(self.save_mbps >= 0, "run.save_mbps", "must be >= 0 (0 = no cap)")
        _need(self.full_every >= 0, "run.full_every", "must be >= 0 (0 or 1 = every save full)")
        _need(0 < self.delta_max_ratio <= 1, "run.delta_max_ratio", "must be in (0, 1]")
        _need(self.steps >= 1, "run.steps", "must be >= 1")
        _need(self.save_every >= 0, "run.save_every", "must be >= 0")
        _need(self.log_every >= 1, "run.log_every", "must be >= 1")
        if self.profile_steps is not None:
            a, b = self.profile_steps
            _need(0 <= a < b, "run.profile_steps", "use a:b with 0 <= a < b (steps counted from 0)")
        _need(self.device in ("auto", "cpu", "cuda"), "run.device", "use auto, cpu or cuda")
        _need(self.eval_every >= 0 and self.eval_samples >= 1, "run.eval_every",
              "eval_every must be >= 0 (0 = never) and eval_samples >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """Fault handling in the step loop (nan_guard.py, watchdog.py)."""

    nan_policy: str = "skip"  # a non-finite loss or grad norm: skip the optimizer step on every rank | fail
    nan_max_consecutive: int = 5  # skip: this many non-finite steps in a row end the run (diverged, not a blip)
    hang_timeout_s: float = 600.0  # a rank whose step does not advance for this long is reported hung; 0 = off
    heartbeat_s: float = 1.0  # heartbeat period; a rank silent for max(10 periods, 5 s) is reported dead
    save_on_term: bool = True  # SIGTERM: finish the step, write a checkpoint, exit 85 (resilience/stop.py)
    term_grace_s: float = 60.0  # SIGTERM -> exit within this; the checkpoint is skipped if it would not fit
    startup_timeout_s: float = 900.0  # no first step within this: exit naming the start-up phase; 0 = off

    def __post_init__(self):
        _need(self.nan_policy in ("skip", "fail"), "faults.nan_policy", "use skip or fail (--nan-policy)")
        _need(self.nan_max_consecutive >= 1, "faults.nan_max_consecutive", "must be >= 1")
        _need(self.hang_timeout_s >= 0, "faults.hang_timeout_s", "must be >= 0 (0 = no watchdog)")
        _need(self.heartbeat_s > 0, "faults.heartbeat_s", "must be > 0 seconds")
        _need(self.term_grace_s > 0, "faults.term_grace_s", "must be > 0 seconds (--term-grace-s)")
        _need(self.startup_timeout_s >= 0, "faults.startup_timeout_s", "must be >= 0 (0 = off; --startup-timeout-s)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackConfig:
    """Experiment trackers rank 0 reports to (train/observe/tracking.py)."""

    report_to: tuple[str, ...] | None = None  # None: tensorboard when installed, else none; () = none
    wandb_project: str | None = None  # None: "loongforge"
    wandb_run_name: str | None = None  # None: the run dir's name

    def __post_init__(self):
        bad = [n for n in self.report_to or () if n not in REPORT_TO]
        _need(not bad, "track.report_to", f"unknown {bad}; use a comma list of {', '.join(REPORT_TO)}, or none")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    run: RunConfig
    recipe: str = "tiny"
    faults: FaultConfig = field(default_factory=FaultConfig)
    track: TrackConfig = field(default_factory=TrackConfig)

    def to_dict(self) -> dict:
        return asdict(self)
