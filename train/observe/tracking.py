"""Experiment trackers: what a run reports to TensorBoard and Weights & Biases (`--report-to`).

Rank 0 only, through the libraries themselves (sinks.py). The trainer calls a `Tracker` at four
points: open (after the resume is known), each metrics.jsonl row (MetricsLog's sink), each
checkpoint save, close. `loongforge profile` and `loongforge eval` open the same run again
(`Tracker.for_report`) and add their tables and images.

What is logged per step (`step_scalars`, the values of the metrics.jsonl row):
  train/        loss, flow_loss, lr, grad_norm (ZeRO 1-3), samples_per_s, nonfinite_skips, bad_samples
  train_time/   step_ms and each phase of `loongforge profile` in ms and % of the step: data_wait,
                communication (absent on CUDA without a trace), launch_overhead, compute
  train_ckpt/   save_stall_s (the step loop's wait), write_s (the last background write)
  val/          every val_* metric of --eval-every
and once: the resolved config (TensorBoard text, W&B config). The group names sort with train/ first:
TensorBoard and W&B show groups in name order, and the loss is what a user opens the page for.
TensorBoard writes to RUN_DIR/tensorboard/NAME, NAME the run dir's own (`tensorboard --logdir
RUN_DIR/tensorboard` lists the run by its name, not as `.`; several runs' tensorboard/ folders side by
side under one --logdir stay apart). `loongforge profile / eval` results go to TensorBoard as tables and
images, not as one-point charts (they were 30 of them, above the training curves); W&B keeps them as
the run's summary.

Resume without duplicates: the run dir's tracking.json keeps the W&B run id, reused on --resume
(resume="allow"). TensorBoard opens with purge_step = the restored step, so its reader drops the
killed launch's events from there on. W&B cannot drop history (its rewind is a private preview):
a resumed run starts after the last step the run holds, as W&B itself does online ("resumes from
the last step"); offline that step is read from the run's own .wandb files (wandb_files.py). Steps
the W&B run lacks below the restored one (lost with a killed W&B process) are sent from
metrics.jsonl. So TensorBoard shows the re-run values of the steps between the checkpoint and the
kill, W&B the first ones.

A tracker never fails or blocks training: a W&B server that cannot be reached turns the run
offline (one WARNING; `wandb sync` later), and a sink that raises is turned off with one WARNING.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os

from loongforge.shared.errors import ConfigError, FormatError
from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.config import REPORT_TO, TrainConfig
from loongforge.train.observe import sinks as sinks_mod
from loongforge.train.observe.metrics import read_metrics

log = logging.getLogger(__name__)

STATE_FILE = "tracking.json"
STATE_VERSION = 1
TB_DIR = "tensorboard"
WANDB_PROJECT = "loongforge"
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what --report-to NAME needs importable
# The phases of `loongforge profile` (breakdown.py), as named in a tracker, and their metrics.jsonl keys.
PHASES = (("data_wait", "data_wait_s"), ("communication", "comm_s"), ("launch_overhead", "overhead_s"),
          ("compute", "compute_s"))
TRAIN_KEYS = ("loss", "flow_loss", "lr", "grad_norm", "nonfinite_skips", "bad_samples")


def installed(name: str) -> bool:
    return importlib.util.find_spec(MODULES[name]) is not None


def resolve_report_to(report_to: tuple[str, ...] | None, *, say=None) -> tuple[str, ...]:
    """The trackers to use. None = the default: tensorboard when installed, else none (said through
    `say`, once per run). An explicitly named tracker that is not installed is a ConfigError: one
    line, raised in preflight, before any process group."""
    if report_to is None:
        names = ("tensorboard",) if installed("tensorboard") else ()
        if say is not None:
            say("--report-to: " + ("tensorboard (the default; the package is installed)" if names else
                                   "none (the default when tensorboard is not installed: pip install "
                                   "'loongforge[track]')"))
        return names
    unknown = [n for n in report_to if n not in REPORT_TO]
    if unknown:
        raise ConfigError(f"--report-to: unknown {unknown}; use a comma list of {', '.join(REPORT_TO)}, or none")
    missing = [n for n in report_to if not installed(n)]
    if missing:
        raise ConfigError(f"--report-to {','.join(report_to)}: the {' and '.join(missing)} package is not installed; "
                          f"pip install 'loongforge[track]' (or drop it from --report-to)")
    return tuple(report_to)


def step_scalars(rec: dict) -> dict[str, float]:
    """The tracker scalars of one metrics.jsonl row (module docstring)."""
    out = {f"train/{k}": rec.get(k) for k in TRAIN_KEYS}
    step = rec["step_s"]
    out["train/samples_per_s"] = rec["samples"] / step if step > 0 else None
    out["train_time/step_ms"] = step * 1e3
    for name, key in PHASES:
        v = rec.get(key)
        if v is not None:
            out[f"train_time/{name}_ms"] = v * 1e3
            out[f"train_time/{name}_pct"] = 100.0 * v / step if step > 0 else None
    out["train_ckpt/save_stall_s"] = rec.get("save_s")
    out.update({f"val/{k[4:]}": v for k, v in rec.items() if k.startswith("val_")})
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def tb_run_name(run_dir: str) -> str:
    """The run's name in TensorBoard: its directory's own name (`.` when the events sat in the logdir)."""
    return os.path.basename(os.path.abspath(run_dir)) or "run"


def read_state(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        state = json.load(f)
    if state.get("v") != STATE_VERSION:
        raise FormatError(f"{path}: tracking state version {state.get('v')!r}, this build reads {STATE_VERSION}; "
                          f"delete it to start new tracker runs")
    return state


def _write_state(run_dir: str, state: dict) -> None:
    write_bytes_atomic(os.path.join(run_dir, STATE_FILE), json.dumps(state, indent=1, sort_keys=True).encode())


class Tracker:
    """The sinks of one process; every call is a no-op without any (ranks other than 0, --report-to none)."""

    def __init__(self, sinks: list | None = None):
        self.sinks = list(sinks or [])
        self._pending: dict[str, float] = {}

    @classmethod
    def for_training(cls, cfg: TrainConfig, *, rank: int, start_step: int) -> "Tracker":
        if rank != 0:
            return cls()
        # A relaunch from a checkpoint (the supervisor's, after a fault) says again none of what the start said.
        say = log.info if start_step == 0 else log.debug
        names = resolve_report_to(cfg.track.report_to, say=say)
        if not names:
            return cls()  # --report-to none: no file at all (a stored W&B id stays for a later resume with it)
        run_dir, t = cfg.run.run_dir, cfg.track
        os.makedirs(run_dir, exist_ok=True)
        try:
            old = read_state(run_dir) if cfg.run.resume else None
        except (OSError, ValueError, FormatError) as exc:
            log.warning("%s; new tracker runs are started", exc)
            old = None
        wandb_state, kept = None, (old or {}).get("wandb") or {}
        if "wandb" in names:
            wandb_state = {"id": kept.get("id") or sinks_mod.new_wandb_id(),
                           "project": t.wandb_project or kept.get("project") or WANDB_PROJECT,
                           "name": t.wandb_run_name or kept.get("name") or os.path.basename(os.path.abspath(run_dir))}
        # A resumed run keeps its TensorBoard directory (older runs wrote to tensorboard/ itself): the purge at
        # the restored step applies to the events already there.
        tb_dir = (old or {}).get("tensorboard") or os.path.join(TB_DIR, tb_run_name(run_dir))
        # A resume without W&B keeps its id: a later resume with it continues the same W&B run.
        _write_state(run_dir, {"v": STATE_VERSION, "report_to": list(names), "tensorboard": tb_dir,
                               "wandb": wandb_state or kept or None})
        config = cfg.to_dict()
        tracker = cls()
        if "tensorboard" in names:
            # purge_step: TensorBoard's reader drops the events a killed launch wrote from here on.
            tracker._open(lambda: sinks_mod.TensorBoardSink(os.path.join(run_dir, tb_dir), purge_step=start_step,
                                                            logdir=os.path.join(run_dir, TB_DIR), say=say))
        if wandb_state is not None:
            tracker._open(lambda: sinks_mod.WandbSink(run_dir, config=config, **wandb_state))
        tracker._call("text", start_step, "config", "```\n" + json.dumps(config, indent=1, sort_keys=True) + "\n```")
        if cfg.run.resume and wandb_state is not None:
            tracker._backfill(run_dir, start_step)
        return tracker

    @classmethod
    def for_report(cls, run_dir: str) -> "Tracker":
        """The trackers the run in `run_dir` reports to, for `loongforge profile / eval` (none: a no-op)."""
        try:
            state = read_state(run_dir)
        except (OSError, ValueError, FormatError) as exc:
            log.warning("%s: %s; not reporting to a tracker", os.path.join(run_dir, STATE_FILE), exc)
            return cls()
        tracker = cls()
        if not state:
            return tracker
        names = [n for n in state.get("report_to", ()) if n in MODULES and installed(n)]
        if "tensorboard" in names:
            tracker._open(lambda: sinks_mod.TensorBoardSink(os.path.join(run_dir, state["tensorboard"]),
                                                            logdir=os.path.join(run_dir, TB_DIR), say=log.debug))
        if "wandb" in names and state.get("wandb"):
            tracker._open(lambda: sinks_mod.WandbSink(run_dir, config=None, **state["wandb"]))
        return tracker

    def _open(self, make) -> None:
        try:
            self.sinks.append(make())
        except Exception as exc:  # noqa: BLE001 - a tracker never fails training
            log.warning("experiment tracker not started (%s: %s); training goes on without it",
                        type(exc).__name__, exc)

    def _call(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails training
                log.warning("%s: %s failed (%s: %s); no more reports to it in this process", sink.name, method,
                            type(exc).__name__, exc)
                self.sinks.remove(sink)

    def _backfill(self, run_dir: str, start_step: int) -> None:
        """Rows below the restored step, from metrics.jsonl, to the sinks that keep what they hold (W&B:
        it skips those it has; a killed W&B process may have lost its last rows before the checkpoint)."""
        try:
            rows = [r for r in read_metrics(run_dir) if r["step"] < start_step]
        except (OSError, FormatError):
            return
        self._call("backfill", [(r["step"], step_scalars(r)) for r in rows])

    def log_step(self, rec: dict) -> None:
        """One metrics.jsonl row (MetricsLog calls it after writing the row)."""
        if self.sinks:
            values = step_scalars(rec)
            values.update(self._pending)
            self._pending = {}
            self._call("scalars", rec["step"], values)

    def on_save(self, write_s: float | None) -> None:
        """A checkpoint save began: everything logged so far goes to disk (a kill from here on resumes at
        this step or later), and the last background write's time goes with the next step."""
        if write_s is not None and math.isfinite(write_s):
            self._pending["train_ckpt/write_s"] = float(write_s)
        self._call("flush")

    def report(self, step: int, *, scalars: dict | None = None, tables: dict | None = None,
               images: dict | None = None, text: dict | None = None) -> None:
        """A command's results (`loongforge profile / eval`): scalars, tables {name: (columns, rows)},
        images {name: png path}, text {name: markdown}, attached at training step `step`."""
        self._call("report", step, scalars or {}, tables or {}, images or {}, text or {})

    def close(self) -> None:
        self._call("close")
        self.sinks = []


def report_profile(run_dir: str, b: dict, chart: str | None) -> None:
    """`loongforge profile`: the breakdown table (the last segment's), its phases as scalars, the chart."""
    tracker = Tracker.for_report(run_dir)
    if not tracker.sinks:
        return
    names = dict(zip(("data wait", "communication", "launch/dispatch overhead", "compute"),
                     (name for name, _ in PHASES)))
    rows = [[phase, round(s * 1e3, 4), round(b["percent"][phase], 2)] for phase, s in b["table"].items()]
    scalars = {f"profile/{names.get(p, p.replace(' ', '_'))}_pct": b["percent"][p] for p in b["table"]}
    scalars.update({"profile/step_ms": b["step_s"] * 1e3, "profile/samples_per_s": b["samples_per_s"]})
    tracker.report(b["last_step"] + 1, scalars=scalars, tables={"profile/breakdown": (["phase", "ms", "%"], rows)},
                   images={"profile/chart": chart} if chart else {}, text={"profile/footnote": b["footnote"]})
    tracker.close()


def report_eval(run_dir: str, summary: dict, step: int, plots: list[str]) -> None:
    """`loongforge eval`: MSE and MAE per action group and method (eval.json's "overall"), the episode plots."""
    tracker = Tracker.for_report(run_dir)
    if not tracker.sinks:
        return
    overall = summary["overall"]
    methods = list(overall)
    scalars, tables = {}, {}
    for metric in ("mse", "mae"):
        groups = list(overall[methods[0]][metric])
        tables[f"eval/{metric}"] = (["group", *methods], [[g, *(overall[m][metric][g] for m in methods)]
                                                          for g in groups])
        scalars.update({f"eval/{metric}/{g}/{m}": overall[m][metric][g] for m in methods for g in groups})
    images = {f"eval/{os.path.splitext(os.path.basename(p))[0]}": p for p in plots}
    tracker.report(step, scalars=scalars, tables=tables, images=images)
    tracker.close()
