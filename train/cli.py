"""`loongforge train` and `loongforge profile`. Heavy imports (torch,
deepspeed, matplotlib) happen inside the handlers so `loongforge --help` is fast."""

from __future__ import annotations


def register(subparsers) -> None:
    from loongforge.train.launch import add_train_args

    p = subparsers.add_parser("train", help="train a VLA model with DeepSpeed (run under torchrun/deepspeed "
                                            "for several ranks: python -m loongforge.train ...)")
    add_train_args(p)
    p.set_defaults(func=_train)
    q = subparsers.add_parser("profile", help="step-time breakdown table + chart of a run directory")
    q.add_argument("run_dir", metavar="RUN_DIR")
    q.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    q.add_argument("--no-chart", action="store_true", help="skip profile.png / profile.html")
    q.set_defaults(func=_profile)


def _train(args) -> int:
    from loongforge.train.launch import exit_now, run_args

    # Never returns: os._exit after teardown (gloo can abort in interpreter shutdown).
    exit_now(run_args(args))
    return 1  # unreachable


def _profile(args) -> int:
    from loongforge.train import report

    b = report.breakdown(args.run_dir)
    print(report.to_json(b) if args.json else report.format_table(b))
    if not args.no_chart:
        png = report.write_chart(b, args.run_dir)
        html = report.write_html(b, args.run_dir)
        if not args.json:
            print(f"chart: {png}\nhtml:  {html}")
    return 0
