"""The two experiment trackers behind `Tracker` (tracking.py), each through its own library:
TensorBoard event files (torch.utils.tensorboard.SummaryWriter) and a Weights & Biases run (wandb).

Both take the same calls: scalars(step, {tag: value}), text(step, tag, markdown), backfill(rows),
flush(), report(step, scalars, tables, images, text), close(). Imports of the libraries are local:
they are optional (`pip install 'loongforge[track]'`) and only rank 0 of a tracked run pays them.
"""

from __future__ import annotations

import logging
import os
import secrets
import string
import threading

import numpy as np

from loongforge.train.observe import wandb_files

log = logging.getLogger(__name__)

STEP_KEY = "train/loss"  # every training row holds it (tracking.step_scalars)
FINISH_TIMEOUT_S = 60.0  # W&B's upload at the end of a run, bounded: the data stays in RUN_DIR/wandb
INIT_TIMEOUT_S = 20.0  # W&B server unreachable at start: give up after this and log offline


def markdown_table(columns: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.6g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows])


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: str, purge_step: int | None = None, logdir: str | None = None, say=log.info):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: the [track] extra

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step, flush_secs=30)
        root = logdir or log_dir  # the folder to give --logdir: the run then shows under its own name
        say("TensorBoard: run %s (tensorboard --logdir %s)", os.path.relpath(log_dir, root), root)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def text(self, step: int, tag: str, markdown: str) -> None:
        self.writer.add_text(tag, markdown, step)

    def backfill(self, rows) -> None:
        """Nothing: the purge at open keeps what the killed launch flushed before its checkpoint (flush())."""

    def flush(self) -> None:
        self.writer.flush()

    def report(self, step: int, scalars: dict, tables: dict, images: dict, text: dict) -> None:
        from PIL import Image  # pillow comes with matplotlib (the train extra)

        # No scalars: a report's values are one point each (30 one-point charts of `loongforge eval` opened
        # the page above the training curves); its tables carry the same numbers.
        for name, (columns, rows) in tables.items():
            self.writer.add_text(name, markdown_table(columns, rows), step)
        for name, path in images.items():
            with Image.open(path) as im:
                self.writer.add_image(name, np.asarray(im.convert("RGB")), step, dataformats="HWC")
        for name, markdown in text.items():
            self.writer.add_text(name, markdown, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def new_wandb_id() -> str:
    """A W&B run id (its own alphabet and length), made here so that choosing one needs no wandb import."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    """One W&B run in RUN_DIR/wandb, resumed by id (resume="allow"). A training session (`config`
    given) reads `floor`, the last step the run already holds in its local .wandb files, and skips the
    steps up to it, as W&B does online, so every step is in the run once; a command's session (eval,
    profile: no config) adds summaries only and reads nothing."""

    name = "wandb"

    def __init__(self, run_dir: str, *, id: str, project: str, name: str, config: dict | None):  # noqa: A002
        import wandb  # the [track] extra

        self.run_dir, self.id = run_dir, id
        self.floor = wandb_files.last_step(run_dir, id, STEP_KEY) if config is not None else None
        kwargs = dict(project=project, name=name, id=id, resume="allow", dir=run_dir)
        settings = dict(console="off", silent=True, x_save_requirements=False, disable_git=True)
        if "WANDB_INIT_TIMEOUT" not in os.environ:
            settings["init_timeout"] = INIT_TIMEOUT_S
        try:
            self.run = wandb.init(**kwargs, settings=wandb.Settings(**settings))
        except Exception as exc:  # noqa: BLE001 - no server, no login: the run goes on offline
            if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
                raise
            log.warning("W&B: cannot start the run online (%s: %s); logging offline under %s/wandb, upload it "
                        "later with `wandb sync %s/wandb/offline-run-*-%s`", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "", run_dir, run_dir, id)
            wandb.teardown()  # W&B's service still counts the failed run as live under this id
            self.run = wandb.init(**kwargs, mode="offline", settings=wandb.Settings(**settings))
        if config is not None:  # a resumed run's config may change (--resume, --steps): not an error here
            self.run.config.update(config, allow_val_change=True)
        where = (f"{os.path.dirname(self.run.dir)} (offline)" if self.run.offline else self.run.url
                 or "nothing recorded (WANDB_MODE=disabled)")
        log.info("W&B: run %s/%s, id %s: %s%s", project, name, id, where,
                 f"; steps up to {self.floor} are in the run already" if self.floor is not None else "")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.floor is not None and step <= self.floor:
            return
        self.run.log(values, step=step, commit=True)

    def text(self, step: int, tag: str, markdown: str) -> None:
        """Nothing: W&B holds the config as the run's config (wandb.init)."""

    def backfill(self, rows) -> None:
        for step, values in rows:
            self.scalars(step, values)

    def flush(self) -> None:
        """Nothing to do: every row is committed to W&B's process as it is logged."""

    def report(self, step: int, scalars: dict, tables: dict, images: dict, text: dict) -> None:
        """Into the run's summary, not its history: W&B history steps only grow, and these belong to no step."""
        import wandb

        out = dict(scalars)
        out.update({name: wandb.Table(columns=list(cols), data=[list(r) for r in rows])
                    for name, (cols, rows) in tables.items()})
        out.update({name: wandb.Image(path) for name, path in images.items()})
        out.update({name: wandb.Html(f"<pre>{markdown}</pre>") for name, markdown in text.items()})
        self.run.summary.update(out)

    def close(self) -> None:
        """run.finish() uploads what is left; bounded, so an unreachable server never holds the exit."""
        done = threading.Thread(target=self.run.finish, daemon=True, name="wandb-finish")
        done.start()
        done.join(FINISH_TIMEOUT_S)
        if done.is_alive():
            log.warning("W&B: run %s not finished after %.0f s (server unreachable?); its data is in %s: "
                        "`wandb sync` it", self.id, FINISH_TIMEOUT_S, self.run.dir)
