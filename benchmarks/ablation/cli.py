"""`loongforge bench ablation`: each optimization's gain and the cumulative ladder, with the step
breakdown per row (benchmarks/README.md); `--order`: the ordering block; `--report RESULT.json`:
the table of an earlier (possibly partial) result, its plot redrawn beside it."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from loongforge.benchmarks.harness.report import RESULTS_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", choices=("tiny", "small"), default="tiny")
    p.add_argument("--ranks", type=int, help="ranks of every row (default 4; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="two rows, one rank, tiny data (< 90 s idle; make test-full runs it)")
    p.add_argument("--repeats", type=int, help="runs per row (median [min-max]); default 3, 1 with --quick")
    p.add_argument("--steps", type=int, help="timed steps per run (default 8)")
    p.add_argument("--rows", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
                   help="only these row ids, e.g. 0,C10 (the others are listed as not run)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--workdir", type=Path, help="keep the generated dataset, shards and rank logs here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--order", action="store_true", help="run the ordering block instead of the ladder (per-rank "
                                                        "shuffles vs the global order: duplicates, never-seen, "
                                                        "loss over 100 steps; 2 ranks, tiny, learnable data)")
    p.add_argument("--report", type=Path, metavar="RESULT.json", help="print the table of an earlier result and "
                                                                      "redraw its plot; runs nothing")


def _sigterm(signum, frame):
    raise SystemExit(143)  # unwinds through launch()'s finally, which ends this run's ranks


def handle(args: argparse.Namespace) -> int:
    from loongforge.benchmarks.ablation import report
    from loongforge.benchmarks.ablation.run import AblationConfig, run

    if args.report:
        doc = json.loads(args.report.read_text())
        print(report.markdown_table(doc))
        if not args.no_plot:
            print(report.plot(doc, args.report.with_suffix(".png")))
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    if args.order:
        from loongforge.benchmarks.ablation.order import run_order

        order_doc, order_path = run_order(out_dir=args.out, workdir=args.workdir)
        print(order_doc["summary"])
        print(f"\nordering block: {order_path} (plot: {order_doc.get('plot')})")
        return 0
    kw = {k: v for k, v in (("recipe", args.recipe), ("ranks", args.ranks), ("repeats", args.repeats),
                            ("steps", args.steps), ("only", args.rows)) if v is not None}
    cfg = AblationConfig.quick_preset(**kw) if args.quick else AblationConfig(**kw)
    doc, path = run(cfg, out_dir=args.out, workdir=args.workdir, plot=not args.no_plot)
    print(report.markdown_table(doc))
    print(f"\nresults: {path}" + (f" (plot: {doc['plot']})" if doc.get("plot") else ""))
    failed = [r["id"] for r in doc["rows"] if r["status"].startswith("failed")]
    return 1 if failed else 0
