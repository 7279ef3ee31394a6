"""`loongforge bench`: LoongForge's data path against the loaders users run
today, timed in the same run on the same machine. Prints one markdown table
and writes benchmarks/results/<date>-<host>.json (+ .png beside it)."""

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (< 2 min; what CI runs)")
    p.add_argument("--repeats", type=int, help="repeats per figure (median and min-max reported); "
                                               "default 3, 1 with --quick")
    p.add_argument("--workers", type=_workers, help="loader worker counts to compare (default 0,1,2)")
    p.add_argument("--gops", type=_gops, help="P1's keyframe intervals, e.g. 2,20,250 (default 2,20,250; "
                                                "2,20,100 with --quick); the largest is the source GOP of the shards")
    p.add_argument("--batch-size", type=int, help="samples per batch, both loaders (default 8, 4 with --quick)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    p.add_argument("--workdir", type=Path, help="keep the generated dataset and shards here (default: a temp dir); "
                                              "must be new, empty or an earlier bench workdir: it is wiped")
    p.add_argument("--no-components", action="store_true",
                   help="skip the folded-in component benchmarks (benchmarks/preprocess.py, cache.py)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def handle(args: argparse.Namespace) -> int:
    from loongforge.benchmarks.config import BenchConfig
    from loongforge.benchmarks.report import markdown_table
    from loongforge.benchmarks.run import DEFAULT_OUT, run

    base = BenchConfig.quick_preset() if args.quick else BenchConfig()
    gop = max(args.gops) if args.gops else None
    cfg = base.with_overrides(repeats=args.repeats, workers=args.workers, batch_size=args.batch_size, gops=args.gops,
                              gop=gop,
                              components=False if args.no_components else None)
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
    from loongforge.benchmarks.ablation_cli import register as register_ablation

    register_ablation(p.add_subparsers(dest="bench_cmd", metavar="{ablation}"))
