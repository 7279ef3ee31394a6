"""`python -m loongforge.train.warm --fd N`: the elastic supervisor's fork server, warm. It imports, once,
everything a rank imports before its first step (the trainer, torch, DeepSpeed with its ZeRO optimizers,
transformers' blocks of the model, TensorBoard's writer, the NV12 kernel) and the checkpoint converter,
then forks ranks and conversions on request from the listening socket the supervisor passes as fd N
(resilience/elastic/forks.py: how, and why a fork is safe here). It sits above `launch` because it
runs a rank's whole entry point; nothing imports it.
"""

from __future__ import annotations

import argparse
import socket

import deepspeed  # noqa: F401 - warm: every rank imports it (parallel/engine.py)
from deepspeed.checkpoint import ds_to_universal  # noqa: F401 - warm: a conversion forks it (ckpt/universal.py)

from loongforge.train import launch
from loongforge.train.data import colorspace_jit
from loongforge.train.parallel.engine import import_muon_uncompiled
from loongforge.train.resilience.elastic import convert, forks
from loongforge.train.resilience.rundir import refuse_before_imports

try:  # warm: the default --report-to writer (observe/sinks.py); absent without the [track] extra
    import torch.utils.tensorboard  # noqa: F401
except ImportError:
    pass


def rank(argv: list[str]) -> int:
    """What `python -m loongforge.train ARGV` runs (train/__main__.py); never returns from a run."""
    refuse_before_imports(argv)
    launch.main(argv)
    return 0


ENTRIES = {"rank": ("loongforge.train.__main__", rank),
           "convert": ("loongforge.train.resilience.elastic.convert", convert.main)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loongforge.train.warm")
    p.add_argument("--fd", type=int, required=True, help="the listening Unix socket, bound by the supervisor")
    p.add_argument("--room", default="", help="padding: room in /proc/PID/cmdline for a forked rank's argv")
    args = p.parse_args(argv)
    import_muon_uncompiled()  # DeepSpeed's ZeRO optimizers import it at their first use
    colorspace_jit.warm_up()  # the loader's first call otherwise (a disk-cache load, a compile once)
    forks.ForkServer(socket.socket(fileno=args.fd), ENTRIES).serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
