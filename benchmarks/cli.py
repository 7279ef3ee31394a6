"""`loongforge bench`: LoongForge's data path against the loaders users run
today, timed in the same run on the same machine. Prints one markdown table
and writes results/<date>-<host>.json (+ .png beside it)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _workers(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: give comma-separated counts, e.g. 0,1,2") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: counts must be >= 0")
    return vals


def _gops(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gops {text!r}: give comma-separated keyframe intervals, e.g. 2,20,250") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"--gops {text!r}: intervals must be >= 1")
    return vals


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated counts, e.g. 1,2,4,8") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 1")
    return vals


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    """`loongforge bench scale` (benchmarks/scale/run.py)."""
    g = p.add_argument_group("scale (loongforge bench scale)")
    g.add_argument("--ranks", type=_ints, default=(1, 2, 4, 8), help="rank counts to run (default 1,2,4,8)")
    g.add_argument("--plan", action="append", help="dp or tp=T,sp=S[,zero=Z][,compress=R]; repeat to compare "
                                                   "(default: dp and tp=2,sp=2)")
    g.add_argument("--recipe", default="tiny", help="recipe the jobs train (default tiny)")
    g.add_argument("--micro-batch", type=int, default=2, help="samples per data-parallel replica per step")
    g.add_argument("--scale-steps", type=int, default=4, help="steps per job (the first is warm-up)")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    g.add_argument("--project-to", type=_ints, default=(32, 64, 128), help="GPU counts to project to")
    g.add_argument("--project-recipe", default="1.6b", help="recipe whose bytes the projection scales to")
    g.add_argument("--compute-s", type=float, default=None, help="GPU compute seconds per step at the projected "
                   "sizes (default 2.86: the seed's 4.15 s step minus its 1.29 s comm, 1.6b on 32 GPUs)")
    g.add_argument("--nvlink-gbps", type=float, default=150.0, help="achieved NVLink GB/s per GPU")
    g.add_argument("--nvlink-latency-us", type=float, default=5.0)
    g.add_argument("--ib-gbps", type=float, default=40.0, help="achieved InfiniBand GB/s per GPU")
    g.add_argument("--ib-latency-us", type=float, default=10.0)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--from-json", type=Path, default=None, help="re-project an earlier scale JSON with these "
                   "inputs (no new measurement); writes <name>-reprojected.json/.png beside it")
    g.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4), help="bytes per element on the GPUs "
                   "(2: bf16, as the trainer on CUDA; the gloo runs measure fp32)")


def handle_scale(args: argparse.Namespace) -> int:
    from loongforge.benchmarks.scale import run as scale
    from loongforge.benchmarks.scale.alpha_beta import Hardware
    from loongforge.benchmarks.harness.run import DEFAULT_OUT
    from loongforge.benchmarks.scale.report import tables

    hw = Hardware(gpus_per_node=args.gpus_per_node, nvlink_gbps=args.nvlink_gbps,
                  nvlink_latency_us=args.nvlink_latency_us, ib_gbps=args.ib_gbps, ib_latency_us=args.ib_latency_us)
    compute_s = scale.SEED_COMPUTE_S if args.compute_s is None else args.compute_s
    if args.from_json:
        import json

        doc = scale.reproject(json.loads(args.from_json.read_text()), hw=hw, sizes=args.project_to,
                              compute_s=compute_s, dtype_bytes=args.dtype_bytes)
        path = scale.save(doc, args.from_json.with_name(args.from_json.stem + "-reprojected.json"),
                          plot=not args.no_plot)
        print(tables(doc))
        print(f"\nresults: {path}")
        return 0
    doc, path = scale.run(args.ranks, args.plan or ["dp", "tp=2,sp=2"], recipe=args.recipe, steps=args.scale_steps,
                          micro_batch=args.micro_batch, device=args.device, out_dir=args.out or DEFAULT_OUT, hw=hw,
                          sizes=args.project_to, project_recipe=args.project_recipe,
                          compute_s=compute_s,
                          dtype_bytes=args.dtype_bytes,
                          workdir=str(args.workdir) if args.workdir else None, plot=not args.no_plot,
                          version=getattr(args, "format", None) or 2)
    print(tables(doc))
    print(f"\nresults: {path}" + ("" if args.no_plot else f" (plot: {path.with_suffix('.png')})"))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="data", choices=("data", "scale"),
                   help="data: the data-path benchmark (default); scale: TP x SP x DP scale-up on gloo + projection")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (< 2 min; what CI runs)")
    p.add_argument("--repeats", type=int, help="repeats per figure (median and min-max reported); "
                                               "default 3, 1 with --quick")
    p.add_argument("--workers", type=_workers, help="loader worker counts to compare (default 0,1,2)")
    p.add_argument("--gops", type=_gops, help="P1's keyframe intervals, e.g. 2,20,250 (default 2,20,250; "
                                                "2,20,100 with --quick); the largest is the source GOP of the shards")
    p.add_argument("--batch-size", type=int, help="samples per batch, both loaders (default 8, 4 with --quick)")
    p.add_argument("--out", type=Path, help="results folder (default results)")
    p.add_argument("--workdir", type=Path, help="keep the generated dataset and shards here (default: a temp dir); "
                                              "must be new, empty or an earlier bench workdir: it is wiped")
    p.add_argument("--no-components", action="store_true",
                   help="skip the folded-in component benchmarks (benchmarks/loader/preprocess.py, cache.py)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--format", type=int, choices=(1, 2), default=None,
                   help="shard format P2-P5 and `bench scale` read (default 2, what preprocess writes; 1: the v1 "
                        "window loader). P1 always measures both")
    add_scale_arguments(p)


def handle(args: argparse.Namespace) -> int:
    if getattr(args, "suite", "data") == "scale":
        return handle_scale(args)
    from loongforge.benchmarks.harness.config import BenchConfig
    from loongforge.benchmarks.harness.report import markdown_table
    from loongforge.benchmarks.harness.run import DEFAULT_OUT, run

    base = BenchConfig.quick_preset() if args.quick else BenchConfig()
    gop = max(args.gops) if args.gops else None
    cfg = base.with_overrides(repeats=args.repeats, workers=args.workers, batch_size=args.batch_size, gops=args.gops,
                              gop=gop,
                              components=False if args.no_components else None, ours_format=args.format)
    doc, path = run(cfg, out_dir=args.out or DEFAULT_OUT, workdir=args.workdir, plot=not args.no_plot)
    print(markdown_table(doc))
    print(f"\nresults: {path}" + (f" (plot: {path.with_suffix('.png')})" if doc.get("plot") else ""))
    failed = [r["id"] for r in doc["rows"] if r["status"].startswith("failed")]
    return 1 if failed else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark the data path against the on-the-fly baseline",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=handle)
    from loongforge.benchmarks.ablation.cli import register as register_ablation

    from loongforge.benchmarks.faults.run import register as register_faults

    sub = p.add_subparsers(dest="bench_cmd", metavar="{ablation,faults}")
    register_ablation(sub)
    register_faults(sub)
