"""`loongforge tune ac / batch / buckets`: registration and handlers. The handlers import the
tuners (torch, the model, the data path) so that `loongforge --help` does not."""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

from loongforge.shared.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="measure activation checkpointing / batch size against a memory budget")
    sub = p.add_subparsers(dest="tune_command", metavar="WHAT", required=True)
    ac = sub.add_parser("ac", help="activation bytes and recompute share for --ac-every in {off,1,2,4,8}")
    _common(ac)
    ac.add_argument("--micro-batch", type=int, default=4, help="samples per rank per forward")
    ac.add_argument("--reps", type=int, default=2, help="timed steps per setting (median), after one warm-up")
    ac.set_defaults(func=_run_ac)
    b = sub.add_parser("batch", help="largest micro-batch within a memory budget")
    _common(b)
    b.add_argument("--ac-every", type=int, default=0, help="activation checkpointing as in training (0 = off)")
    b.add_argument("--fp8", action="store_true", help="measure with FP8 linears (as --fp8 in training)")
    b.add_argument("--fp8-min-features", type=int, default=256)
    b.add_argument("--limit", type=int, default=256, help="largest micro-batch tried")
    b.set_defaults(func=_run_batch, micro_batch=1)
    _add_buckets(sub)


def _common(p) -> None:
    p.add_argument("--memory-budget", required=True, help="activation bytes per rank, e.g. 2GiB, 512MiB")
    p.add_argument("--recipe", default="small", help="tiny | small | gr00t-n1.6")
    p.add_argument("--data", default=None, help="shard root; default: a synthetic root in a temp dir")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"), help="as the trainer's")
    p.add_argument("--json", default=None, help="where to write the result (default ./tune_<what>.json)")
    p.add_argument("--video-deltas", type=_deltas, default=None, metavar="D,D,...",
                   help="frame offsets per sample, as `train --video-deltas` (K = their count; default 0, "
                   "-3,-2,-1,0 on the synthetic root)")


def _deltas(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers (e.g. -1,0), got {text!r}") from None


def _add_buckets(sub) -> None:
    p = sub.add_parser("buckets", help="step time and exposed comm per ZeRO bucket size (and overlap_comm)",
                       description="sweep ZeRO's reduce / all-gather (ZeRO-3: prefetch) bucket size and "
                                   "overlap_comm with real trainer launches on this machine (train/tune/buckets.py)")
    p.add_argument("--world", type=int, default=2, help="local ranks (torchrun --nproc_per_node)")
    p.add_argument("--plan", default="dp", help="dp or tp=T,sp=S[,zero=Z][,compress=R] (default dp, ZeRO-2)")
    p.add_argument("--sizes", default="20000,200000,2000000,50000000", help="bucket sizes in bytes, comma-separated")
    p.add_argument("--overlap", default="both", choices=("both", "on", "off"), help="overlap_comm settings to try")
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--steps", type=int, default=4, help="steps per setting (the first is warm-up)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per data-parallel replica per step")
    p.add_argument("--data", default=None, help="shard root; default: a synthetic root in a temp dir")
    p.add_argument("--workdir", default=None, help="keep the run directories here (default: a temp dir)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", default=None, help="where to write the result (default ./tune_buckets.json)")
    p.set_defaults(func=_run_buckets)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"--memory-budget: {text!r} is not a size; write e.g. 512MiB, 2GiB or 3000000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--sizes {text!r}: give comma-separated byte counts, e.g. 200000,2000000") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"--sizes {text!r}: sizes must be >= 1")
    return vals


def _run_ac(a) -> int:
    from loongforge.train.tune.ac import format_ac_table, seq_len, tune_ac, workload_from_args
    from loongforge.train.tune.results import write_json

    budget = parse_bytes(a.memory_budget)
    with workload_from_args(a) as w:
        result = tune_ac(w, a.micro_batch, budget, reps=a.reps)
        result.update(recipe=a.recipe, seq_len=seq_len(w))
    print(format_ac_table(result))
    out = a.json or os.path.join(os.getcwd(), "tune_ac.json")
    write_json(result, out)
    print(f"json: {out}")
    return 0 if result["choice"] is not None else 1


def _run_batch(a) -> int:
    from loongforge.train.kernels.precision import convert_fp8
    from loongforge.train.tune.ac import workload_from_args
    from loongforge.train.tune.batch import format_batch_table, tune_batch
    from loongforge.train.tune.results import write_json

    budget = parse_bytes(a.memory_budget)
    if a.limit < 1:
        raise ConfigError("--limit: must be >= 1")
    with workload_from_args(a) as w:
        if a.fp8:
            convert_fp8(w.model, device=w.device, min_features=a.fp8_min_features)
        result = tune_batch(w, budget, ac_every=a.ac_every, limit=a.limit)
        result.update(recipe=a.recipe, fp8=a.fp8)
    print(format_batch_table(result))
    out = a.json or os.path.join(os.getcwd(), "tune_batch.json")
    write_json(result, out)
    print(f"json: {out}")
    return 0 if result["micro_batch"] else 1


def _run_buckets(args) -> int:
    from loongforge.train.tune.buckets import sweep, table

    overlaps = {"both": (True, False), "on": (True,), "off": (False,)}[args.overlap]
    with tempfile.TemporaryDirectory(prefix="loongforge-buckets-") as tmp:
        doc = sweep(world=args.world, plan=args.plan, sizes=parse_sizes(args.sizes), overlaps=overlaps,
                    recipe=args.recipe, steps=args.steps, micro_batch=args.micro_batch, data=args.data,
                    workdir=args.workdir or tmp, device=args.device)
    print(table(doc))
    path = args.json or "tune_buckets.json"
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nresults: {path}")
    return 0
