"""Launcher entry: `python -m loongforge.train ARGS` under torchrun, the
deepspeed launcher, or alone (one rank). Thin: parse -> build -> run -> close.

gloo processes sometimes abort at interpreter exit ("terminate called without
an active exception"), so after destroy_process_group() we flush and leave
with os._exit(code): a launch returns the run's real exit code, reliably.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from loongforge.shared.errors import ConfigError, LoongForgeError


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


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="shard root (directory or URL holding index.json)")
    p.add_argument("--run-dir", required=True, help="metrics.jsonl, checkpoints/, traces/ go here")
    p.add_argument("--recipe", default="tiny", help="tiny | small | 1.6b")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to reach (total, counting resumed)")
    p.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch per optimizer step (all ranks)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--workers", type=int, default=0, help="decode worker processes per rank (0 = inline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bad-samples", default="skip", choices=("skip", "raise"))
    p.add_argument("--video-deltas", type=_ints, default=(0,), help="frame offsets around each sample's t, "
                   "comma-separated (GR00T: 0; history: --video-deltas=-6,-4,-2,0)")
    p.add_argument("--action-horizon", type=int, default=0, help="action rows per sample (0 = the index's)")
    p.add_argument("--sample-stride", type=int, default=1, help="every s-th timestep is a sample")
    p.add_argument("--block-run", type=int, default=4, help="samples of one frame block kept together in the "
                   "order (1 = a random permutation at --block-window >= the epoch)")
    p.add_argument("--block-window", type=int, default=65536, help="shuffle buffer of the order, samples")
    p.add_argument("--block-cache-mb", type=float, default=256.0, help="decoded-block cache per decode worker, "
                   "MiB")
    p.add_argument("--cache-socket", default=None, help="cache daemon unix socket (reads go through the cache)")
    p.add_argument("--cache-tcp", default=None, help="cache daemon HOST:PORT")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest if present")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    p.add_argument("--sync-save", action="store_true", help="write checkpoints in the step loop (default: "
                   "snapshot to host memory, write in the background)")
    p.add_argument("--save-busy", default="wait", choices=("wait", "skip"),
                   help="a save due while the previous one is still being written: wait for it, or skip this one")
    p.add_argument("--keep-last", type=int, default=0, help="keep the newest K checkpoints (0 = all); one "
                   "before `latest` always stays, "
                   "the fallback when `latest` fails its sha256 check on --resume")
    p.add_argument("--save-mbps", type=float, default=0.0, help="cap the checkpoint write rate, MB/s (0 = none)")
    p.add_argument("--full-every", type=int, default=0, help="full checkpoint every N saves, XOR+zstd deltas "
                   "against it in between (0 = every save full)")
    p.add_argument("--delta-max-ratio", type=float, default=0.5, help="write a save full when its delta would "
                   "exceed this fraction of a full one")
    p.add_argument("--profile-steps", type=_steps_range, default=None, help="a:b torch.profiler trace of steps [a,b)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    p.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex", "flash"),
                   help="attention kernel for the multimodal mask (train/README.md); the log says which runs")
    p.add_argument("--reduce-bucket-size", type=int, default=50_000_000)
    p.add_argument("--no-overlap-comm", action="store_true")
    p.add_argument("--zero3-leaf-blocks", action="store_true", help="ZeRO-3: fetch each transformer block's "
                   "parameters as one unit (DeepSpeed leaf modules), not per sub-layer: fewer hooks and "
                   "gathers; for small models, whose per-layer hooks cost more than their math")
    p.add_argument("--no-ds-breakdown", action="store_true", help="turn off DeepSpeed's wall_clock_breakdown "
                   "(its per-step timer lines); our breakdown in metrics.jsonl does not need it")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: the trunk's attention and MLP "
                   "split over TP ranks (train/parallel/); data-parallel size = ranks / (tp * sp)")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree: the video tokens split over SP "
                   "ranks, Ulysses attention (train/parallel/video_sp.py); heads %% (tp*sp) == 0")
    p.add_argument("--grad-compression", default="none", choices=("none", "topk"), help="topk: ZeRO-3 shards "
                   "inside each SP group, replicas sync gradients by top-k + error feedback (needs --zero 3)")
    p.add_argument("--compress-ratio", type=float, default=3.0, help="dense all-reduce bytes / bytes sent per "
                   "bucket (a bucket where sparse would not win goes dense; 1 = dense everywhere)")
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0, help="log validation flow loss and action MSE every N "
                   "steps (the index's --val-episodes split); 0 = never")
    p.add_argument("--ds-log-level", default="WARNING", help="level of DeepSpeed's logger (INFO: its setup chatter)")
    p.add_argument("--check-config", action="store_true", help="validate recipe, batch divisibility (for "
                   "WORLD_SIZE ranks) and the data root, then exit: 0 ok, 2 config error; no process group. "
                   "The launch scripts run it in the launcher process first")
    p.add_argument("--ac-every", type=int, default=0, help="activation checkpointing of every Nth block "
                   "(0 = off; `loongforge tune ac` measures the choice)")
    p.add_argument("--fp8", action="store_true", help="FP8 linears via torchao (CUDA capability >= 8.9)")
    p.add_argument("--fp8-warmup-steps", type=int, default=0, help="blend BF16 -> FP8 over N steps")
    p.add_argument("--fp8-warmup-mode", default="blend", choices=("blend", "switch"))
    p.add_argument("--fp8-recipe", default="tensorwise", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    p.add_argument("--fp8-min-features", type=int, default=256, help="GEMMs with a smaller dim stay BF16")
    p.add_argument("--fuse", default="auto", choices=("auto", "on", "off"), help="torch.compile of the "
                   "transformer blocks (fused norm/residual/dropout); auto = on CUDA with ZeRO < 3")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs over the transformer blocks "
                   "(torch.compile reduce-overhead; --fuse off: graphs without inductor fusion); CUDA, ZeRO < 3, "
                   "no --ac-every, no --tp; refused on CPU")
    p.add_argument("--batch-plan", default=None, help="`loongforge tune batch` JSON: global batch = its "
                   "micro-batch x ranks x --grad-accum (overrides --batch-size)")
    p.add_argument("--nan-policy", default="skip", choices=("skip", "fail"), help="a non-finite loss or grad "
                   "norm: skip the optimizer step on every rank and count it in metrics.jsonl, or end the run")
    p.add_argument("--nan-max-consecutive", type=int, default=5, help="with skip: end the run after more than "
                   "N non-finite steps in a row")
    p.add_argument("--hang-timeout-s", type=float, default=600.0, help="watchdog: a rank whose step does not "
                   "advance for this long is reported hung and the launch ends (exit 75); 0 = off")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period to the launch's TCPStore; "
                   "a rank silent for max(10 periods, 5 s) is reported dead")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(a: argparse.Namespace):
    from loongforge.train.config import (DataConfig, FaultConfig, MemoryConfig, ModelConfig, OptimConfig,
                                         ParallelConfig, RunConfig, TrainConfig)

    return TrainConfig(
        recipe=a.recipe,
        data=DataConfig(root=a.data, global_batch_size=_global_batch(a), num_workers=a.workers, seed=a.seed,
                        bad_samples=a.bad_samples, cache_socket=a.cache_socket,
                        cache_tcp=a.cache_tcp, video_deltas=a.video_deltas, action_horizon=a.action_horizon,
                        sample_stride=a.sample_stride, block_run=a.block_run, block_window=a.block_window,
                        block_cache_mb=a.block_cache_mb),
        model=ModelConfig(attention=getattr(a, "attention", "auto")),
        optim=OptimConfig(lr=a.lr),
        parallel=ParallelConfig(zero_stage=a.zero, grad_accum=a.grad_accum, reduce_bucket_size=a.reduce_bucket_size,
                                overlap_comm=not a.no_overlap_comm, precision=a.precision,
                                zero3_leaf_blocks=getattr(a, "zero3_leaf_blocks", False),
                                dist_timeout_s=a.dist_timeout, wall_clock_breakdown=not a.no_ds_breakdown,
                                tp=getattr(a, "tp", 1), sp=getattr(a, "sp", 1),
                                grad_compression=getattr(a, "grad_compression", "none"),
                                compress_ratio=getattr(a, "compress_ratio", 3.0)),
        memory=MemoryConfig(ac_every=a.ac_every, fp8=a.fp8, fp8_warmup_steps=a.fp8_warmup_steps,
                            fp8_warmup_mode=a.fp8_warmup_mode, fp8_recipe=a.fp8_recipe,
                            fp8_min_features=a.fp8_min_features, fuse=a.fuse,
                            cuda_graphs=getattr(a, "cuda_graphs", False)),
        run=RunConfig(run_dir=a.run_dir, steps=a.steps, save_every=a.save_every, resume=a.resume,
                      log_every=a.log_every, profile_steps=a.profile_steps, device=a.device,
                      eval_every=a.eval_every, save_async=not a.sync_save, save_busy=a.save_busy,
                      keep_last=a.keep_last, save_mbps=a.save_mbps, full_every=a.full_every,
                      delta_max_ratio=a.delta_max_ratio),
        faults=FaultConfig(nan_policy=getattr(a, "nan_policy", "skip"),
                           nan_max_consecutive=getattr(a, "nan_max_consecutive", 5),
                           hang_timeout_s=getattr(a, "hang_timeout_s", 600.0),
                           heartbeat_s=getattr(a, "heartbeat_s", 1.0)),
    )


def _global_batch(a: argparse.Namespace) -> int:
    if not getattr(a, "batch_plan", None):
        return a.batch_size
    from loongforge.train.tune.batch import load_plan

    # WORLD_SIZE is set by torchrun / the deepspeed launcher before this process starts.
    return load_plan(a.batch_plan)["micro_batch"] * int(os.environ.get("WORLD_SIZE", "1")) * a.grad_accum


def run_args(args: argparse.Namespace) -> int:
    """Build, run, close. Returns an exit code; never raises past here."""
    from loongforge.train.parallel import engine
    from loongforge.train.trainer import Trainer

    log = logging.getLogger("loongforge.train")
    logging.getLogger("DeepSpeed").setLevel(getattr(args, "ds_log_level", "WARNING").upper())
    if getattr(args, "check_config", False):
        return check_config(args)
    trainer, code = None, 0
    _terminate_cleanly()
    try:
        trainer = Trainer(config_from_args(args))
        trainer.run()
    except _Terminated:
        print("loongforge train: terminated (SIGTERM: the launcher stops this rank because a peer failed, or "
              "the job was preempted); resume with --resume from the last checkpoint", file=sys.stderr)
        code = 143
    except ConfigError as exc:
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
        code = 2
    except LoongForgeError as exc:
        print(f"loongforge train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - print it, still tear the process group down
        traceback.print_exc()
        code = 1
    finally:
        if trainer is not None:
            trainer.close()
        try:
            engine.shutdown(barrier=code == 0)
        except Exception as exc:  # noqa: BLE001
            log.warning("process group teardown: %s", exc)
    return code


def check_config(args: argparse.Namespace) -> int:
    """`--check-config`: the rank's preflight, alone, in the calling process (exit 0 or 2)."""
    from loongforge.train.preflight import preflight

    try:
        checked = preflight(config_from_args(args))
    except ConfigError as exc:
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
        return 2
    except LoongForgeError as exc:
        print(f"loongforge train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"loongforge train: config ok: recipe {args.recipe}, {checked.world} ranks, micro batch "
          f"{checked.ds_config['train_micro_batch_size_per_gpu']}, {checked.index.num_samples} samples")
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` closes the loader (its decode workers and
    shared-memory slots) instead of the process vanishing mid-step."""


def _terminate_cleanly() -> None:
    # Launchers send SIGTERM to every rank when one fails (deepspeed's to the whole process tree,
    # torchrun's before SIGKILL after a grace period), and so does a preempting scheduler.
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one teardown; a second TERM must not cut it short
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_term)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loongforge.train", description="LoongForge trainer (one rank)")
    add_train_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_now(run_args(args))


if __name__ == "__main__":  # `deepspeed --num_gpus N path/to/launch.py ...` (script-path form)
    main()
