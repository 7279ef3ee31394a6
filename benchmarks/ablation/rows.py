"""The ablation ladder: which configuration each row trains, in the seed's order.

Row 0 is the baseline (on-the-fly PyAV decode loader, plain DP with ZeRO-2, dense-mask
SDPA, no activation checkpointing, no compression, DeepSpeed's default buckets without
overlap). Block "cumulative" adds one optimization per row on top of the previous row;
block "alone" adds each optimization by itself to the baseline. A `Setting` is the whole
configuration of one row; `train_argv` turns it into `loongforge train` arguments, so
every row runs the real trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from loongforge.shared.errors import ConfigError
from loongforge.train.config import ParallelConfig

DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (the baseline's)
TUNED_BUCKET = 2_000_000  # elements: a few buckets per step for tiny/small, so reduction starts during backward
AC_EVERY = 2  # tiny and small have 2-8 blocks per tower; every 4 would checkpoint one of tiny's


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    loader: str = "pyav"  # pyav (on-the-fly decode) | shards (offline NV12 shards + worker pool)
    workers: int = 1  # loader worker processes per rank, same for both loaders
    cache: bool = False  # read through the cache daemon, which gets the announced shard order
    prefetch: int = 0  # loader batches staged ahead by the prefetch thread; 0 = staged inline in next()
    tp: int = 1
    sp: int = 1
    zero: int = 2
    zero3_leaf: bool = False  # ZeRO-3 fetches each transformer block as one unit (--zero3-leaf-blocks)
    compression: bool = False  # top-k + error feedback across DP replicas (needs ZeRO-3)
    bucket: int = DS_DEFAULT_BUCKET
    overlap: bool = False
    attention: str = "sdpa"
    ac_every: int = 0
    precision: str = "fp32"
    fp8: bool = False
    batch_scale: int = 1  # global batch multiplier (the larger batch the freed memory allows)


@dataclass(frozen=True, slots=True)
class Optimization:
    id: str
    label: str
    apply: Callable[[Setting, "Plan"], Setting]
    gpu_only: str | None = None  # why a CPU number would mean nothing (None: runs on CPU)


@dataclass(frozen=True, slots=True)
class Plan:
    """Machine facts the ladder depends on."""

    ranks: int
    cuda: bool
    sp_accepted: bool  # the trainer takes --sp > 1 (probed)
    heads: int = 4  # attention heads of the recipe: TP splits them

    @property
    def hybrid(self) -> tuple[int, int]:
        """(tp, sp) of the hybrid row: TP 2 innermost, SP 2 when the trainer accepts it and
        a DP dimension of >= 2 remains for gradient compression."""
        tp = next((t for t in (2, 3, 5) if self.ranks % t == 0 and self.heads % t == 0), 1)
        sp = 2 if self.sp_accepted and self.ranks % (tp * 2) == 0 and self.ranks // (tp * 2) >= 2 else 1
        return tp, sp


def _hybrid(s: Setting, plan: Plan) -> Setting:
    tp, sp = plan.hybrid
    # ZeRO-3 as a user of a small model configures it: blocks fetched whole (DeepSpeed leaf modules),
    # not one hook pair + gather per sub-layer (profiled: half the host calls of the step).
    return dataclasses.replace(s, tp=tp, sp=sp, zero=3, zero3_leaf=True)


OPTIMIZATIONS: tuple[Optimization, ...] = (
    Optimization("shards", "offline shards + worker pool", lambda s, p: dataclasses.replace(s, loader="shards")),
    Optimization("cache", "+ cache daemon + announced prefetch",
                 lambda s, p: dataclasses.replace(s, loader="shards", cache=True)),
    Optimization("prefetch", "+ async prefetch", lambda s, p: dataclasses.replace(s, loader="shards", prefetch=2)),
    Optimization("hybrid", "+ hybrid TP x SP x DP, ZeRO-3", _hybrid),
    Optimization("compress", "+ top-k gradient compression (3:1, error feedback)",
                 lambda s, p: dataclasses.replace(s, zero=3, zero3_leaf=True, compression=True)),
    Optimization("buckets", "+ bucket size / overlap tuning",
                 lambda s, p: dataclasses.replace(s, bucket=TUNED_BUCKET, overlap=True)),
    Optimization("attention", "+ attention kernel (flash/flex for the multimodal mask)",
                 lambda s, p: dataclasses.replace(s, attention="auto"),
                 gpu_only="flash-attn / compiled FlexAttention: no CPU backward in torch 2.13"),
    Optimization("ac", f"+ activation checkpointing every {AC_EVERY}",
                 lambda s, p: dataclasses.replace(s, ac_every=AC_EVERY)),
    Optimization("precision", "+ BF16 autocast / FP8 linears",
                 lambda s, p: dataclasses.replace(s, precision="bf16", fp8=True),
                 gpu_only="BF16 tensor cores and FP8 GEMMs (capability >= 8.9); CPU has neither"),
    Optimization("batch", "+ larger batch (2x) from the freed memory",
                 lambda s, p: dataclasses.replace(s, batch_scale=2)),
)


@dataclass(frozen=True, slots=True)
class RowSpec:
    id: str
    block: str  # baseline | cumulative | alone
    label: str
    setting: Setting
    skip: str | None = None  # "needs GPU: ..." or why the row cannot run at this rank count
    note: str = ""


def _runnable(opt: Optimization, s: Setting, plan: Plan) -> str | None:
    if opt.gpu_only and not plan.cuda:
        return f"needs GPU ({opt.gpu_only})"
    if opt.id == "hybrid" and plan.hybrid[0] == 1:
        return f"no TP degree in (2, 3, 5) divides both --ranks {plan.ranks} and the {plan.heads} heads"
    if opt.id == "compress" and plan.ranks // (s.tp * s.sp) < 2:
        return f"needs >= 2 data-parallel replicas (ranks {plan.ranks}, tp {s.tp} x sp {s.sp})"
    return None


def _note(opt: Optimization, plan: Plan) -> str:
    if opt.id != "hybrid":
        return ""
    tp, sp = plan.hybrid
    why = "" if sp > 1 else (" (trainer refuses --sp > 1: TP only)" if not plan.sp_accepted
                             else f" (SP 2 would leave no DP replica at {plan.ranks} ranks: TP only)")
    return f"tp {tp} x sp {sp} x dp {plan.ranks // (tp * sp)}{why}"


def ladder(plan: Plan, quick: bool = False) -> list[RowSpec]:
    base = Setting()
    rows = [RowSpec("0", "baseline", "baseline: PyAV on-the-fly decode, DP ZeRO-2, dense SDPA", base)]
    if quick:  # the smoke run: the baseline against the first data-path row
        return rows + [RowSpec("C1", "cumulative", OPTIMIZATIONS[0].label, OPTIMIZATIONS[0].apply(base, plan))]
    s = base
    for i, opt in enumerate(OPTIMIZATIONS, 1):
        skip = _runnable(opt, s, plan)
        if skip is None:
            s = opt.apply(s, plan)
        rows.append(RowSpec(f"C{i}", "cumulative", opt.label, s, skip=skip, note=_note(opt, plan)))
    for i, opt in enumerate(OPTIMIZATIONS[1:], 2):  # A1 would repeat C1 (shards alone on the baseline)
        skip = _runnable(opt, base, plan)
        st = opt.apply(base, plan) if skip is None else base
        if opt.id in ("cache", "prefetch"):  # data-path rows need the shard loader to exist
            st = dataclasses.replace(st, loader="shards")
        label = opt.label.lstrip("+ ") + (" (on shards)" if opt.id in ("cache", "prefetch") else "")
        rows.append(RowSpec(f"A{i}", "alone", label, st, skip=skip, note=_note(opt, plan)))
    return rows


def train_argv(s: Setting, *, shards: str, run_dir: str, recipe: str, batch: int, steps: int, seed: int,
               cuda: bool, cache_socket: str | None, frames: int = 4, stride: int = 4) -> list[str]:
    """`loongforge train` arguments of one row; every row reads the same samples: K = `frames`
    frames per camera at video deltas -(K-1)..0, every `stride`-th timestep."""
    deltas = ",".join(str(d) for d in range(1 - frames, 1))
    argv = ["--data", shards, "--video-deltas=" + deltas, "--sample-stride", str(stride),
            "--run-dir", run_dir, "--recipe", recipe, "--steps", str(steps),
            "--batch-size", str(batch * s.batch_scale), "--zero", str(s.zero), "--workers", str(s.workers),
            "--seed", str(seed), "--tp", str(s.tp), "--attention", s.attention, "--ac-every", str(s.ac_every),
            "--reduce-bucket-size", str(s.bucket), "--no-ds-breakdown", "--save-every", "0",
            "--device", "cuda" if cuda else "cpu", "--precision", s.precision if cuda else "fp32",
            "--log-every", "1000000"]
    if s.sp > 1:
        argv += ["--sp", str(s.sp)]
    if not s.overlap:
        argv.append("--no-overlap-comm")
    if s.zero == 3 and s.zero3_leaf:
        argv.append("--zero3-leaf-blocks")
    if s.compression:
        argv += ["--grad-compression", "topk", "--compress-ratio", "3"]
    if s.fp8 and cuda:
        argv.append("--fp8")
    if s.cache and cache_socket:
        argv += ["--cache-socket", cache_socket]
    return argv


def sp_accepted(ranks: int) -> bool:
    """Does this trainer take --sp 2? Probed the way `loongforge train --check-config` validates it
    (the ParallelConfig dataclass), without a process."""
    try:
        ParallelConfig(tp=2, sp=2, zero_stage=3)
    except (ConfigError, TypeError):
        return False
    return True
