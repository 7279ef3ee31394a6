"""`loongforge bench <name>`: one subcommand per benchmark, each with its own options
(`loongforge bench <name> --help`); results go to the checkout's results/ folder.
`python -m loongforge.benchmarks <name>` is the same command."""

from __future__ import annotations

import argparse
import importlib
import sys

from loongforge.shared.errors import LoongForgeError

# name -> (module with add_arguments(parser) and handle(args) -> exit code, one-line help)
BENCHMARKS = {
    "data": ("loongforge.benchmarks.harness.run", "the data path (P1-P5) against the on-the-fly loaders users run "
                                                  "today, same machine, same run"),
    "scale": ("loongforge.benchmarks.scale.run", "TP x SP x DP scale-up on gloo, projected to 32-128 GPUs"),
    "ablation": ("loongforge.benchmarks.ablation.cli", "each optimization's gain and the cumulative ladder, "
                                                       "with the step breakdown per row"),
    "faults": ("loongforge.benchmarks.faults.run", "fault injection against a real 2-rank elastic run"),
    "memory": ("loongforge.benchmarks.micro.memory", "GPU memory per rank of the released N1.6 by layout "
                                                      "(model states exact, activations from a full-size forward)"),
    "ckpt": ("loongforge.benchmarks.micro.ckpt", "checkpoint stall: no saves vs synchronous vs asynchronous"),
    "startup": ("loongforge.benchmarks.micro.startup", "time to first step (imports, data, model, DeepSpeed, first "
                                                       "step) at 1 and 2 ranks, and a restart after a rank's SIGKILL"),
    "storage": ("loongforge.benchmarks.micro.storage", "bytes and decode CPU of the shard root vs the source mp4"),
    "index-scale": ("loongforge.benchmarks.micro.index_scale", "opening and looking up the index at 100 M samples"),
    "order-scale": ("loongforge.benchmarks.micro.order_scale", "one rank's epoch order at 10-100 M samples"),
    "conversion": ("loongforge.benchmarks.micro.conversion", "CPU NV12 -> normalized RGB, fused vs unfused"),
    "checksum-cost": ("loongforge.benchmarks.micro.checksum_cost", "what the per-block xxh3 check costs a worker"),
    "serve": ("loongforge.benchmarks.micro.serve", "get_action round trips through `loongforge serve`: p50/p95/p99 "
                                                    "by recipe, batch and clients, split decode/preprocess/model/encode"),
    "image-transform": ("loongforge.benchmarks.micro.image_transform", "N1.6's image transform on the device: "
                        "composed weight matrices vs the torch-interpolate path"),
    "closed-loop": ("loongforge.benchmarks.sim.closed_loop", "demos from a simulated task's expert -> preprocess -> "
                    "train -> closed-loop success rate against the expert, random and state-only BC"),
    "gpu-check": ("loongforge.benchmarks.micro.gpu_check", "everything only a GPU can check, in one short run"),
    "block-loader": ("loongforge.benchmarks.loader.block_loader", "the decode worker's body per block size, "
                                                                  "the block order's diversity, the loader's CPU "
                                                                  "account and its goals against on-the-fly decode"),
    "cache": ("loongforge.benchmarks.loader.cache", "cache hit rate, RAM-tier bandwidth, cold-miss latency"),
    "preprocess": ("loongforge.benchmarks.loader.preprocess", "preprocess throughput against PyAV decoding"),
    "lerobot-baseline": ("loongforge.benchmarks.loader.lerobot_baseline", "the LeRobotDataset-compatible adapter's "
                         "fast path against LeRobot-style PyAV loading, GOP 2 and long GOP"),
    "lerobot-parity": ("loongforge.benchmarks.loader.lerobot_parity", "LeRobotDataset's items against the real "
                       "lerobot 0.6.1's, item by item (needs --lerobot-venv)"),
    "preprocess-dask": ("loongforge.benchmarks.micro.preprocess_dask", "preprocess frames/s on 1 vs 2 dask workers "
                                                                      "vs the local runner (scaling efficiency)"),
}


class _BenchParser(argparse.ArgumentParser):
    """A benchmark's parser whose options come from its module when the parser is used (parsing
    or help), so `loongforge --help` does not import every benchmark."""

    def __init__(self, *args, module: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module

    def _load(self) -> None:
        if not self._module:
            return
        module, self._module = importlib.import_module(self._module), ""
        self.description = self.description or module.__doc__
        module.add_arguments(self)
        self.set_defaults(func=module.handle)

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        got, extra = super().parse_known_args(args, namespace)
        if extra:  # said by this benchmark's parser, with its usage, not by `loongforge`'s
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return got, extra

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME", parser_class=_BenchParser,
                           title="benchmarks (loongforge bench NAME --help for its options)")
    for name, (module, text) in BENCHMARKS.items():
        sub.add_parser(name, help=text, module=module, formatter_class=argparse.RawDescriptionHelpFormatter)

    def no_name(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=no_name)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: loongforge bench NAME (the list: loongforge bench)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    """`python -m loongforge.benchmarks`: the same subcommands outside the `loongforge` command."""
    import logging

    p = argparse.ArgumentParser(prog="python -m loongforge.benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except LoongForgeError as exc:
        print(f"{p.prog} {args.bench}: error: {exc}", file=sys.stderr)
        return 1
