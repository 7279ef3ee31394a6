"""One rank: `python -m loongforge.train ARGS` under torchrun, the deepspeed launcher, the elastic
supervisor, or alone. Thin: parse -> die with the launcher -> signals -> Trainer -> run -> close ->
tear the process group down -> exit code (resilience/exits.py lists the codes and says why the
process leaves with os._exit; resilience/stop.py how SIGINT and SIGTERM end a run).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback

from loongforge.shared.errors import ConfigError, LoongForgeError, UsageError
from loongforge.train.ckpt.files import ckpt_root, read_pointer
from loongforge.train.flags import add_train_args, config_from_args
from loongforge.train.parallel.engine import shutdown
from loongforge.train.preflight import preflight
from loongforge.train.resilience import owner
from loongforge.train.resilience.exits import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_PEER_FAULT, EXIT_PREEMPTED,
                                               EXIT_TERMINATED, PLANNED_WORLD_ENV, RESUME_ENV, SUPERVISOR_ENV,
                                               Interrupted, Preempted, Terminated, debug_log, exit_now, peer_gone,
                                               resume_command, supervised, supervisor_alive)
from loongforge.train.resilience.rundir import refuse_over_checkpoints
from loongforge.train.resilience.stop import StopSignals, record_stop
from loongforge.train.resilience.threads import pin_threads
from loongforge.train.trainer import Trainer

log = logging.getLogger("loongforge.train")


def run_args(args: argparse.Namespace) -> int:
    """Build, run, close. Returns an exit code; never raises past here."""
    logging.getLogger("DeepSpeed").setLevel(args.ds_log_level.upper())
    try:  # before any process group: a fresh run over checkpoints, a world the supervisor did not plan
        refuse_over_checkpoints(args.run_dir, resume=args.resume, overwrite=args.overwrite)
        _check_planned_world()
    except ConfigError as exc:
        return _config_error(args, exc)
    if args.check_config:
        return check_config(args)
    pin_threads()
    _own_by_launcher()
    stop = StopSignals(save_on_term=not args.no_save_on_term, grace_s=args.term_grace_s).install()
    trainer, code, stopped, lost_peer = None, 0, None, False
    try:
        trainer = Trainer(config_from_args(args), stop=stop)
        trainer.run()
    except (Preempted, Terminated, Interrupted) as exc:
        stopped = exc
    except ConfigError as exc:
        code = _config_error(args, exc)
    except LoongForgeError as exc:
        print(f"loongforge train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    except BaseException as exc:  # noqa: BLE001 - report it, still tear the process group down
        stop.tearing_down()  # the launcher stops the survivors of a failure: its SIGTERM must not cut this short
        if stop.requested:  # a SIGTERM, then a collective failed: a peer is gone (the launcher stops us)
            stopped, lost_peer = Terminated("a peer left before the checkpoint"), True
        elif trainer is not None and peer_gone(exc):  # after start-up: a start-up failure is shown as it is
            code, lost_peer = _peer_gone(args, exc), True
        else:
            traceback.print_exc()
            code = 1
    finally:
        stop.tearing_down()
        if trainer is not None:
            trainer.close(peers_gone=lost_peer)  # after it, `latest` is final: no save is in flight
        try:
            shutdown(barrier=code == 0 and stopped is None)
        except Exception as exc:  # noqa: BLE001
            log.warning("process group teardown: %s", exc)
        stop.finish()
    return _stopped(stopped, args, trainer) if stopped is not None else code


def _config_error(args: argparse.Namespace, exc: ConfigError) -> int:
    """One line (rank 0 only when every rank finds the same: the run dir, the planned world), exit 2."""
    if os.environ.get("RANK", "0") == "0" or not isinstance(exc, UsageError):
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
    _record_config_error(args, exc)
    return EXIT_CONFIG


def _check_planned_world() -> None:
    """Under the elastic supervisor the checkpoint was converted for the world it planned: a launch that
    came up with another world (a torchrun option slipped in) must not load it under the wrong label."""
    planned, world = os.environ.get(PLANNED_WORLD_ENV), os.environ.get("WORLD_SIZE", "1")
    if planned and planned != world:
        raise UsageError(f"this launch has {world} ranks but the elastic supervisor planned {planned} (and "
                         "converted the checkpoint for them): multi-node runs take --nodes, not torchrun options "
                         "in LOONGFORGE_TORCHRUN_ARGS")


def _peer_gone(args: argparse.Namespace, exc: BaseException) -> int:
    """A collective failed because a peer is gone: the traceback to the node's log, one WARNING (none under
    the supervisor: it names the rank that failed), exit 75."""
    where = debug_log(args.run_dir, "a peer is gone; this rank's traceback:\n" +
                      "".join(traceback.format_exception(exc)))
    if not supervised():
        last = " ".join(str(exc).split())[:160]
        log.warning("rank %s: a peer is gone (%s: %s); leaving with exit %d (the launcher names the rank that "
                    "failed first; this traceback: %s)", os.environ.get("RANK", "0"), type(exc).__name__, last,
                    EXIT_PEER_FAULT, where)
    return EXIT_PEER_FAULT


def _own_by_launcher() -> None:
    """Under a launcher, die with it (owner.py); a plain `loongforge train` keeps its own life."""
    chain = owner.launcher_chain()
    if not chain:
        return
    owner.die_with_parent(signal.SIGTERM)
    if os.getppid() != chain[0][0]:  # the launcher died before the kernel could be asked
        os.kill(os.getpid(), signal.SIGTERM)
    owner.LauncherWatch(chain[1:]).start()


def _stopped(exc: BaseException, args: argparse.Namespace, trainer) -> int:
    """One line (rank 0) for a run ended by a signal, and its exit code; under the elastic supervisor
    a record for it instead (it reports the stop) and exit 0, so torchrun ends quietly."""
    rank = trainer.rank if trainer is not None else int(os.environ.get("RANK", "0"))
    step = trainer.step if trainer is not None else None
    latest = read_pointer(ckpt_root(args.run_dir))
    when = "during start-up" if step is None else f"at step {step}"  # steps done: the console's last "step N"
    if isinstance(exc, Preempted):
        code, what = EXIT_PREEMPTED, f"stopped by SIGTERM after step {exc.step}: checkpoint {exc.tag} written"
    elif isinstance(exc, Interrupted):
        code, what = EXIT_INTERRUPTED, f"interrupted (SIGINT) {when}; last checkpoint {latest or 'none'}"
    else:
        code, what = EXIT_TERMINATED, f"terminated (SIGTERM: {exc.why}) {when}; last checkpoint {latest or 'none'}"
    if rank == 0:
        if supervised():
            record_stop(args.run_dir, code=code, step=step, latest=latest, why=what)
        if not supervised():
            print(f"loongforge train: {what}; resume: {resume_command()}", file=sys.stderr, flush=True)
        elif not supervisor_alive():  # it was killed: nobody else will say how to go on
            print(f"loongforge train: {what} (the elastic supervisor, pid {os.environ[SUPERVISOR_ENV]}, is gone); "
                  f"resume: {os.environ.get(RESUME_ENV) or resume_command()}", file=sys.stderr, flush=True)
    return 0 if supervised() else code


def _record_config_error(args: argparse.Namespace, exc: ConfigError) -> None:
    """Under the supervisor: a config error is not a fault to retry; rank 0 says so in metrics.jsonl."""
    if supervised() and os.environ.get("RANK", "0") == "0":
        record_stop(args.run_dir, code=EXIT_CONFIG, why=f"config error: {exc}", config_error=True)


def check_config(args: argparse.Namespace) -> int:
    """`--check-config`: the rank's preflight, alone, in the calling process (exit 0 or 2); the run-dir
    check (a fresh run over checkpoints) ran before it in run_args."""
    try:
        cfg = config_from_args(args)
        checked = preflight(cfg)
    except ConfigError as exc:
        print(f"loongforge train: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except LoongForgeError as exc:
        print(f"loongforge train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"loongforge train: config ok: recipe {cfg.recipe}, {checked.world} ranks, micro batch "
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
