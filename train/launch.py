"""One rank: `python -m loongforge.train ARGS` under torchrun, the deepspeed launcher, or alone.
Thin: parse -> Trainer -> run -> close -> tear the process group down -> exit code
(resilience/exits.py says why the process leaves with os._exit).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from loongforge.shared.errors import ConfigError, LoongForgeError
from loongforge.train.flags import add_train_args, config_from_args
from loongforge.train.parallel.engine import shutdown
from loongforge.train.preflight import preflight
from loongforge.train.resilience.exits import EXIT_CONFIG, EXIT_TERMINATED, Terminated, exit_now, terminate_cleanly
from loongforge.train.trainer import Trainer

log = logging.getLogger("loongforge.train")


def run_args(args: argparse.Namespace) -> int:
    """Build, run, close. Returns an exit code; never raises past here."""
    logging.getLogger("DeepSpeed").setLevel(args.ds_log_level.upper())
    if args.check_config:
        return check_config(args)
    trainer, code = None, 0
    terminate_cleanly()
    try:
        trainer = Trainer(config_from_args(args))
        trainer.run()
    except Terminated:
        print("loongforge train: terminated (SIGTERM: the launcher stops this rank because a peer failed, or "
              "the job was preempted); resume with --resume from the last checkpoint", file=sys.stderr)
        code = EXIT_TERMINATED
    except ConfigError as exc:
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
        code = EXIT_CONFIG
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
            shutdown(barrier=code == 0)
        except Exception as exc:  # noqa: BLE001
            log.warning("process group teardown: %s", exc)
    return code


def check_config(args: argparse.Namespace) -> int:
    """`--check-config`: the rank's preflight, alone, in the calling process (exit 0 or 2)."""
    try:
        checked = preflight(config_from_args(args))
    except ConfigError as exc:
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except LoongForgeError as exc:
        print(f"loongforge train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"loongforge train: config ok: recipe {args.recipe}, {checked.world} ranks, micro batch "
          f"{checked.ds_config['train_micro_batch_size_per_gpu']}, {checked.index.num_samples} samples")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loongforge.train", description="LoongForge trainer (one rank)")
    add_train_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_now(run_args(args))


if __name__ == "__main__":  # `deepspeed --num_gpus N path/to/launch.py ...` (script-path form)
    main()
