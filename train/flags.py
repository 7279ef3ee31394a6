"""The flags of `loongforge train` and `python -m loongforge.train`, and the TrainConfig they make.

Every default comes from the config dataclasses (config.py), so a default is written once;
the flags only say how a value is spelled on the command line. Torch-free: `loongforge --help`
registers these.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from loongforge.shared.errors import ConfigError
from loongforge.train.config import (ATTENTION_BACKENDS, BAD_SAMPLE_POLICIES, LR_SCHEDULES, RECIPE_LR, DataConfig,
                                     FaultConfig, MemoryConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig,
                                     TrackConfig, TrainConfig)
from loongforge.train.ckpt.hub import resolve_checkpoint
from loongforge.train.tune.results import load_plan


def _default(cls, name: str):
    """The default of field `name` of config class `cls`: the one place it is written."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _steps_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile-steps wants a:b (e.g. 3:6), got {text!r}") from None
    return a, b


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers (e.g. -6,-4,-2,0), got {text!r}") from None


def _jitter(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("off", "none", "0"):
        return ()
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 4 or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"want brightness,contrast,saturation,hue (e.g. 0.3,0.4,0.5,0.08) or off, "
                                         f"got {text!r}")
    return vals


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, action="append", metavar="ROOT[:RATIO]", help="shard root (directory or "
                   "URL holding index.json); repeat it to mix several roots, each ROOT:RATIO (N1.6's rule: a root's "
                   "share of the samples is its ratio), or give a mixture file (.json: [{\"root\": R, \"ratio\": "
                   "3}, ...])")
    p.add_argument("--run-dir", required=True, help="metrics.jsonl, checkpoints/, traces/ go here")
    p.add_argument("--recipe", default=None, help="GR00T N1.6 at a size: tiny (default) | small | gr00t-n1.6 (the "
                   "released architecture, 2.96 B parameters); with --init-from the checkpoint's config.json decides "
                   "(recorded as gr00t-n1.6, whose peak lr, 1e-4, is the default)")
    p.add_argument("--init-from", default=None, metavar="DIR|ORG/NAME", help="fine-tune an Isaac-GR00T N1.6 "
                   "checkpoint: a directory (config.json + model*.safetensors; its tokenizer files, or --tokenizer) "
                   "or a hub id (nvidia/GR00T-N1.6-3B) through huggingface_hub's cache (downloaded once when "
                   "online; HF_HUB_OFFLINE=1 reads the cache only)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="directory of the tokenizer files (default: "
                   "--init-from's; without one, bytes)")
    p.add_argument("--embodiment-tag", default=None, help="a check: the GR00T embodiment tag the data must have (the "
                   "tag, its modality config and statistics are chosen at `loongforge preprocess --embodiment-tag`)")
    p.add_argument("--override-statistics", action="store_true", help="with --init-from: normalise every embodiment "
                   "with the data's statistics (default, as N1.6: the checkpoint's own for the tags it has)")
    p.add_argument("--state-dropout", type=float, default=None, help="N1.6's state_dropout_prob: the share of samples "
                   "whose state tokens are replaced by a learned mask token in training (default: the model's, 0)")
    p.add_argument("--color-jitter", type=_jitter, default=None, metavar="B,C,S,H", help="training colour jitter "
                   "(brightness, contrast, saturation, hue; default the recipe's: N1.6's 0.3,0.4,0.5,0.08; 'off')")
    for name, what in (("llm", "the LLM (all its kept layers)"), ("visual", "the vision tower and mlp1"),
                       ("projector", "the state/action encoders and decoder"),
                       ("diffusion-model", "the DiT"), ("vlln", "the LayerNorm on the backbone features")):
        p.add_argument(f"--tune-{name}", default=None, action=argparse.BooleanOptionalAction,
                       help=f"train {what} (default: the recipe's: all of it from scratch; N1.6's with --init-from)")
    p.add_argument("--tune-top-llm-layers", type=int, default=None, help="train the top N LLM layers even when "
                   "--no-tune-llm (N1.6: 4)")
    p.add_argument("--dit-dropout", type=float, default=None, help="the DiT's dropout (default: the model's, N1.6 "
                   "0.2)")
    p.add_argument("--steps", type=int, default=_default(RunConfig, "steps"), help="optimizer steps to reach "
                   "(total, counting resumed)")
    p.add_argument("--batch-size", type=int, default=_default(DataConfig, "global_batch_size"),
                   help="GLOBAL batch per optimizer step (all ranks)")
    p.add_argument("--grad-accum", type=int, default=_default(ParallelConfig, "grad_accum"))
    p.add_argument("--zero", type=int, default=_default(ParallelConfig, "zero_stage"), choices=(0, 1, 2, 3),
                   help="ZeRO stage")
    p.add_argument("--workers", type=int, default=_default(DataConfig, "num_workers"), help="decode worker "
                   "processes per rank (0 = inline)")
    p.add_argument("--seed", type=int, default=_default(DataConfig, "seed"))
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's, "
                   f"{', '.join(f'{k} {v:g}' for k, v in RECIPE_LR.items())})")
    p.add_argument("--lr-schedule", default=_default(OptimConfig, "lr_schedule"), choices=LR_SCHEDULES,
                   help="linear warm-up, then cosine or linear decay to 0 at --steps (or constant)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warmup-steps", type=int, default=_default(OptimConfig, "warmup_steps"),
                      help="linear warm-up over N optimizer steps (default: --warmup-ratio of --steps)")
    warm.add_argument("--warmup-ratio", type=float, default=_default(OptimConfig, "warmup_ratio"),
                      help="warm-up as a fraction of --steps")
    p.add_argument("--min-lr-ratio", type=float, default=_default(OptimConfig, "min_lr_ratio"),
                   help="lr at the end of the decay, as a fraction of the peak")
    p.add_argument("--weight-decay", type=float, default=_default(OptimConfig, "weight_decay"),
                   help="AdamW's decoupled weight decay")
    p.add_argument("--grad-clip", type=float, default=_default(OptimConfig, "grad_clip"),
                   help="clip the global gradient norm to this (0 = off)")
    p.add_argument("--bad-samples", default=_default(DataConfig, "bad_samples"), choices=BAD_SAMPLE_POLICIES)
    p.add_argument("--video-deltas", type=_ints, default=_default(DataConfig, "video_deltas"),
                   help="frame offsets around each sample's t, comma-separated (default: the modality config's, "
                   "N1.6: 0; history: --video-deltas=-6,-4,-2,0)")
    p.add_argument("--action-horizon", type=int, default=_default(DataConfig, "action_horizon"),
                   help="action rows per sample (0 = the modality config's; only for roots without relative actions)")
    p.add_argument("--action-pad", default=_default(DataConfig, "action_pad"), choices=("none", "last", "zero"),
                   help="none (N1.6): a sample only where its whole action chunk lies in the episode; last / zero: "
                   "every timestep, the chunk past the end padded and masked out of the loss")
    p.add_argument("--sample-stride", type=int, default=_default(DataConfig, "sample_stride"),
                   help="every s-th timestep is a sample")
    p.add_argument("--block-run", type=int, default=_default(DataConfig, "block_run"), help="samples of one frame "
                   "block kept together in the order (1 = a random permutation at --block-window >= the epoch)")
    p.add_argument("--block-window", type=int, default=_default(DataConfig, "block_window"),
                   help="shuffle buffer of the order, samples")
    p.add_argument("--block-cache-mb", type=float, default=_default(DataConfig, "block_cache_mb"),
                   help="decoded-block cache per decode worker, MiB")
    p.add_argument("--cache-socket", default=_default(DataConfig, "cache_socket"), help="cache daemon unix socket "
                   "(reads go through the cache)")
    p.add_argument("--cache-tcp", default=_default(DataConfig, "cache_tcp"), help="cache daemon HOST:PORT")
    fresh = p.add_mutually_exclusive_group()
    fresh.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest if present "
                       "(without it a run dir holding checkpoints is refused, exit 2)")
    fresh.add_argument("--overwrite", action="store_true", help="start afresh on a run dir that holds checkpoints: "
                       "the old run is moved aside to RUN_DIR.replaced-TIME, never deleted")
    p.add_argument("--save-every", type=int, default=_default(RunConfig, "save_every"), help="checkpoint every N "
                   "steps (0 = only at the end)")
    p.add_argument("--sync-save", action="store_true", help="write checkpoints in the step loop (default: snapshot "
                   "to host memory, write in the background)")
    p.add_argument("--save-busy", default=_default(RunConfig, "save_busy"), choices=("wait", "skip"),
                   help="a save due while the previous one is still being written: wait for it, or skip this one")
    p.add_argument("--keep-last", type=int, default=_default(RunConfig, "keep_last"), help="keep the newest K "
                   "checkpoints (0 = all); one before `latest` always stays, the fallback when `latest` fails its "
                   "sha256 check on --resume")
    p.add_argument("--save-mbps", type=float, default=_default(RunConfig, "save_mbps"), help="cap the checkpoint "
                   "write rate, MB/s (0 = none)")
    p.add_argument("--full-every", type=int, default=_default(RunConfig, "full_every"), help="full checkpoint every "
                   "N saves, XOR+zstd deltas against it in between (0 = every save full)")
    p.add_argument("--delta-max-ratio", type=float, default=_default(RunConfig, "delta_max_ratio"),
                   help="write a save full when its delta would exceed this fraction of a full one")
    p.add_argument("--profile-steps", type=_steps_range, default=_default(RunConfig, "profile_steps"),
                   help="a:b torch.profiler trace of steps [a,b)")
    p.add_argument("--device", default=_default(RunConfig, "device"), choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default=_default(ParallelConfig, "precision"), choices=("auto", "bf16", "fp32"))
    p.add_argument("--attention", default=_default(ModelConfig, "attention"), choices=ATTENTION_BACKENDS,
                   help="attention kernel for the multimodal mask (train/README.md); the log says which runs")
    p.add_argument("--reduce-bucket-size", type=int, default=_default(ParallelConfig, "reduce_bucket_size"))
    p.add_argument("--no-overlap-comm", action="store_true")
    p.add_argument("--zero3-leaf-blocks", action="store_true", help="ZeRO-3: fetch each transformer block's "
                   "parameters as one unit (DeepSpeed leaf modules), not per sub-layer: fewer hooks and gathers; "
                   "for small models, whose per-layer hooks cost more than their math")
    p.add_argument("--ds-breakdown", action="store_true", help="turn on DeepSpeed's wall_clock_breakdown (its "
                   "per-step `[Rank 0] time (ms)` lines); our breakdown in metrics.jsonl does not need it")
    p.add_argument("--no-ds-breakdown", action="store_true", help=argparse.SUPPRESS)  # the default now; accepted
    p.add_argument("--tp", type=int, default=_default(ParallelConfig, "tp"), help="tensor-parallel degree: the "
                   "attention and MLP of the vision tower, LLM and DiT split over TP ranks (train/parallel/); "
                   "data-parallel size = ranks / (tp * sp)")
    p.add_argument("--sp", type=int, default=_default(ParallelConfig, "sp"), help="sequence-parallel degree: the "
                   "images and the LLM's image tokens split over SP ranks, Ulysses attention "
                   "(train/parallel/video_sp.py); LLM KV heads %% (tp*sp) == 0")
    p.add_argument("--grad-compression", default=_default(ParallelConfig, "grad_compression"),
                   choices=("none", "topk"), help="topk: ZeRO-3 shards inside each SP group, replicas sync "
                   "gradients by top-k + error feedback (needs --zero 3)")
    p.add_argument("--compress-ratio", type=float, default=None,
                   help="with --grad-compression topk: dense all-reduce bytes / bytes sent per bucket (a bucket where "
                   "sparse would not win goes dense; 1 = dense everywhere; default "
                   f"{_default(ParallelConfig, 'compress_ratio'):g})")
    p.add_argument("--compress-warmup-steps", type=int, default=_default(ParallelConfig, "compress_warmup_steps"),
                   help="with --grad-compression topk: the first N optimizer steps sync gradients dense")
    p.add_argument("--dist-timeout", type=float, default=_default(ParallelConfig, "dist_timeout_s"),
                   help="seconds before a stuck collective fails")
    p.add_argument("--log-every", type=int, default=_default(RunConfig, "log_every"))
    p.add_argument("--eval-every", type=int, default=_default(RunConfig, "eval_every"), help="log validation flow "
                   "loss and action MSE every N steps (the index's --val-episodes split); 0 = never")
    p.add_argument("--ds-log-level", default="WARNING", help="level of DeepSpeed's logger (INFO: its setup chatter)")
    p.add_argument("--check-config", action="store_true", help="validate recipe, batch divisibility (for WORLD_SIZE "
                   "ranks) and the data root, then exit: 0 ok, 2 config error; no process group. The launch scripts "
                   "run it in the launcher process first")
    p.add_argument("--ac-every", type=int, default=_default(MemoryConfig, "ac_every"), help="activation "
                   "checkpointing of every Nth block (0 = off; `loongforge tune ac` measures the choice)")
    p.add_argument("--fp8", action="store_true", help="FP8 linears via torchao (CUDA capability >= 8.9)")
    p.add_argument("--fp8-warmup-steps", type=int, default=_default(MemoryConfig, "fp8_warmup_steps"),
                   help="blend BF16 -> FP8 over N steps")
    p.add_argument("--fp8-warmup-mode", default=_default(MemoryConfig, "fp8_warmup_mode"),
                   choices=("blend", "switch"))
    p.add_argument("--fp8-recipe", default=_default(MemoryConfig, "fp8_recipe"),
                   choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    p.add_argument("--fp8-min-features", type=int, default=_default(MemoryConfig, "fp8_min_features"),
                   help="GEMMs with a smaller dim stay BF16")
    p.add_argument("--fuse", default=_default(MemoryConfig, "fuse"), choices=("auto", "on", "off"),
                   help="torch.compile of the transformer blocks (fused norm/residual/dropout); auto = on CUDA with "
                   "ZeRO < 3")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs over the transformer blocks "
                   "(torch.compile reduce-overhead; --fuse off: graphs without inductor fusion); CUDA, ZeRO < 3, no "
                   "--ac-every, no --tp; refused on CPU")
    p.add_argument("--batch-plan", default=None, help="`loongforge tune batch` JSON: global batch = its micro-batch "
                   "x ranks x --grad-accum (overrides --batch-size)")
    p.add_argument("--nan-policy", default=_default(FaultConfig, "nan_policy"), choices=("skip", "fail"),
                   help="a non-finite loss or grad norm: skip the optimizer step on every rank and count it in "
                   "metrics.jsonl, or end the run")
    p.add_argument("--nan-max-consecutive", type=int, default=_default(FaultConfig, "nan_max_consecutive"),
                   help="with skip: end the run after more than N non-finite steps in a row")
    p.add_argument("--hang-timeout-s", type=float, default=_default(FaultConfig, "hang_timeout_s"),
                   help="watchdog: a rank whose step does not advance for this long is reported hung and the launch "
                   "ends (exit 75); 0 = off")
    p.add_argument("--heartbeat-s", type=float, default=_default(FaultConfig, "heartbeat_s"),
                   help="heartbeat period to the launch's TCPStore; a rank silent for max(10 periods, 5 s) is "
                   "reported dead")
    p.add_argument("--no-save-on-term", action="store_true", help="SIGTERM stops at once (exit 143) instead of "
                   "finishing the step and writing a checkpoint first (exit 85)")
    p.add_argument("--term-grace-s", type=float, default=_default(FaultConfig, "term_grace_s"), help="SIGTERM: "
                   "leave within this many seconds; the checkpoint is skipped (WARNING) when it would not fit. Keep "
                   "it inside the scheduler's grace window")
    p.add_argument("--startup-timeout-s", type=float, default=_default(FaultConfig, "startup_timeout_s"),
                   help="a rank whose first step has not finished after this long exits, naming the start-up "
                   "phase it is stuck in (0 = off)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    t = p.add_argument_group("experiment tracking (rank 0; train/observe/tracking.py)")
    t.add_argument("--report-to", type=_report_to, default=_default(TrackConfig, "report_to"), metavar="LIST",
                   help="comma list of tensorboard, wandb, or none (default: tensorboard when installed, else none; "
                   "pip install 'loongforge[track]'). TensorBoard: RUN_DIR/tensorboard; W&B: RUN_DIR/wandb, "
                   "WANDB_MODE=offline honoured")
    t.add_argument("--wandb-project", default=_default(TrackConfig, "wandb_project"), help="W&B project "
                   "(default: loongforge)")
    t.add_argument("--wandb-run-name", default=_default(TrackConfig, "wandb_run_name"), help="W&B run name "
                   "(default: the run dir's name); a --resume keeps the run id stored in RUN_DIR/tracking.json")


def _report_to(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if "none" in names:
        if len(names) > 1:
            raise argparse.ArgumentTypeError(f"--report-to {text!r}: none cannot be combined with a tracker")
        return ()
    return names


def _compress_ratio(a: argparse.Namespace) -> float:
    """--compress-ratio means something only with --grad-compression topk: refused alone, not ignored."""
    if a.compress_ratio is None:
        return _default(ParallelConfig, "compress_ratio")
    if a.grad_compression != "topk":
        raise ConfigError(f"--compress-ratio {a.compress_ratio:g} needs --grad-compression topk (without it the "
                          "gradients sync dense and the ratio would be ignored)")
    return a.compress_ratio


def _recipe(a: argparse.Namespace) -> str:
    """--recipe, or with --init-from gr00t-n1.6 (the checkpoint's architecture; Isaac-GR00T's fine-tune lr)."""
    if getattr(a, "init_from", None) is None:
        return a.recipe or _default(TrainConfig, "recipe")
    if a.recipe not in (None, "gr00t-n1.6"):
        raise ConfigError(f"--recipe {a.recipe} with --init-from: the checkpoint's config.json decides the "
                          "architecture; drop --recipe")
    return "gr00t-n1.6"


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        recipe=_recipe(a),
        data=DataConfig(root=_roots(a.data)[0][0], mixture=_mixture(a.data), global_batch_size=_global_batch(a),
                        num_workers=a.workers, seed=a.seed,
                        bad_samples=a.bad_samples, cache_socket=a.cache_socket,
                        cache_tcp=a.cache_tcp, video_deltas=a.video_deltas, action_horizon=a.action_horizon,
                        action_pad=a.action_pad,
                        sample_stride=a.sample_stride, block_run=a.block_run, block_window=a.block_window,
                        block_cache_mb=a.block_cache_mb),
        model=ModelConfig(attention=a.attention, init_from=resolve_checkpoint(a.init_from), tokenizer=a.tokenizer,
                          embodiment_tag=a.embodiment_tag, tune_llm=a.tune_llm, tune_visual=a.tune_visual,
                          tune_top_llm_layers=a.tune_top_llm_layers, tune_projector=a.tune_projector,
                          tune_diffusion_model=a.tune_diffusion_model, tune_vlln=a.tune_vlln,
                          dit_dropout=a.dit_dropout, state_dropout=a.state_dropout, color_jitter=a.color_jitter,
                          override_statistics=a.override_statistics),
        optim=OptimConfig(lr=a.lr if a.lr is not None else RECIPE_LR.get(_recipe(a), _default(OptimConfig, "lr")),
                          lr_schedule=a.lr_schedule, warmup_steps=a.warmup_steps, warmup_ratio=a.warmup_ratio,
                          min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, grad_clip=a.grad_clip),
        parallel=ParallelConfig(zero_stage=a.zero, grad_accum=a.grad_accum, reduce_bucket_size=a.reduce_bucket_size,
                                overlap_comm=not a.no_overlap_comm, precision=a.precision,
                                zero3_leaf_blocks=a.zero3_leaf_blocks, dist_timeout_s=a.dist_timeout,
                                wall_clock_breakdown=a.ds_breakdown and not a.no_ds_breakdown, tp=a.tp, sp=a.sp,
                                grad_compression=a.grad_compression, compress_ratio=_compress_ratio(a),
                                compress_warmup_steps=a.compress_warmup_steps),
        memory=MemoryConfig(ac_every=a.ac_every, fp8=a.fp8, fp8_warmup_steps=a.fp8_warmup_steps,
                            fp8_warmup_mode=a.fp8_warmup_mode, fp8_recipe=a.fp8_recipe,
                            fp8_min_features=a.fp8_min_features, fuse=a.fuse, cuda_graphs=a.cuda_graphs),
        run=RunConfig(run_dir=a.run_dir, steps=a.steps, save_every=a.save_every, resume=a.resume,
                      overwrite=a.overwrite,
                      log_every=a.log_every, profile_steps=a.profile_steps, device=a.device,
                      eval_every=a.eval_every, save_async=not a.sync_save, save_busy=a.save_busy,
                      keep_last=a.keep_last, save_mbps=a.save_mbps, full_every=a.full_every,
                      delta_max_ratio=a.delta_max_ratio),
        faults=FaultConfig(nan_policy=a.nan_policy, nan_max_consecutive=a.nan_max_consecutive,
                           hang_timeout_s=a.hang_timeout_s, heartbeat_s=a.heartbeat_s,
                           save_on_term=not a.no_save_on_term, term_grace_s=a.term_grace_s,
                           startup_timeout_s=a.startup_timeout_s),
        track=TrackConfig(report_to=a.report_to, wandb_project=a.wandb_project, wandb_run_name=a.wandb_run_name),
    )


def _roots(values) -> list[tuple[str, float | None]]:
    """--data values -> [(root, ratio or None)]: ROOT, ROOT:RATIO (a URL's own colons stay), or a .json file
    listing {"root", "ratio"} objects."""
    values = [values] if isinstance(values, str) else list(values)
    out: list[tuple[str, float | None]] = []
    for v in values:
        if v.endswith(".json") and os.path.isfile(v):
            try:
                with open(v, encoding="utf-8") as f:
                    doc = json.load(f)
                out += [(str(d["root"]), float(d.get("ratio", 1.0))) for d in doc]
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise ConfigError(f"--data {v}: a mixture file is a JSON list of {{\"root\": ROOT, \"ratio\": R}} "
                                  f"({exc})") from None
            continue
        root, _, tail = v.rpartition(":")
        try:
            out.append((root, float(tail)) if root and "/" not in tail else (v, None))
        except ValueError:
            out.append((v, None))
    return out


def _mixture(values) -> tuple[tuple[str, float], ...]:
    roots = _roots(values)
    if len(roots) == 1 and roots[0][1] is None:
        return ()
    return tuple((r, 1.0 if w is None else w) for r, w in roots)


def _global_batch(a: argparse.Namespace) -> int:
    if not a.batch_plan:
        return a.batch_size
    # WORLD_SIZE is set by torchrun / the deepspeed launcher before this process starts.
    return load_plan(a.batch_plan)["micro_batch"] * int(os.environ.get("WORLD_SIZE", "1")) * a.grad_accum
