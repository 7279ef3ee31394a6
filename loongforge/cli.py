"""`loongforge` console command: one subcommand per service.

Each service module `loongforge.<service>.cli` exposes `register(subparsers)`,
which adds its subcommands with `set_defaults(func=handler)`; a handler takes
the parsed args and returns an exit code. Service CLIs import their heavy
dependencies inside handlers, so `loongforge --help` stays fast and a node that
installed only one extra still gets the other commands' help and a clear error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from loongforge import __version__
from loongforge.shared.errors import LoongForgeError

SERVICES = (
    ("loongforge.preprocess.cli", "preprocess"),
    ("loongforge.cache.cli", "cache"),
    ("loongforge.train.cli", "train"),
    ("loongforge.benchmarks.cli", "dev"),
)


def build_parser(services=SERVICES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loongforge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"loongforge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, extra in services:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("loongforge."):
                continue  # service not built yet
            log_missing = f"{module_name} needs `pip install 'loongforge[{extra}]'` ({exc.name} missing)"
            logging.getLogger(__name__).debug(log_missing)
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None, services=SERVICES) -> int:
    """`services` narrows which service CLIs are imported (a cache node's
    `python -m loongforge.cache` imports only the cache)."""
    parser = build_parser(services)
    args = parser.parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)  # `train --elastic` relaunches with these
    level = "DEBUG" if args.verbose else os.environ.get("LOONGFORGE_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        parser.error(f"LOONGFORGE_LOG_LEVEL={level!r}: use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LoongForgeError as exc:
        print(f"loongforge {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"loongforge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
