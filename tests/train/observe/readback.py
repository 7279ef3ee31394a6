"""Read a run's tracker files back as a user's tools do: TensorBoard's own event reader (which applies
the purge a resumed writer asks for) and the W&B run's local .wandb files (wandb's protobuf records)."""

from __future__ import annotations

import json
import os

from loongforge.train.observe import wandb_files
from loongforge.train.observe.tracking import STATE_FILE, TB_DIR


def tensorboard_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} in file order, as TensorBoard shows them."""
    acc = tensorboard_accumulator(run_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_accumulator(run_dir: str):
    """TensorBoard's reader over the run's TensorBoard directory (tracking.json says which), everything
    loaded (no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(os.path.join(run_dir, STATE_FILE)) as f:
        where = json.load(f).get("tensorboard") or TB_DIR
    acc = EventAccumulator(os.path.join(run_dir, where), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def wandb_id(run_dir: str) -> str:
    with open(os.path.join(run_dir, STATE_FILE)) as f:
        return json.load(f)["wandb"]["id"]


def wandb_history(run_dir: str) -> list[tuple[int, int, dict]]:
    """(session number, step, row) of every history row of the run's .wandb files, oldest session first."""
    files = wandb_files.run_files(run_dir, wandb_id(run_dir))
    return [(n, step, row) for n, path in enumerate(files) for step, row in wandb_files.history(path)]


def wandb_summary(run_dir: str) -> dict:
    """The run's summary updates of every session, merged in order (media as W&B's JSON references)."""
    from wandb.proto import wandb_internal_pb2

    out = {}
    for path in wandb_files.run_files(run_dir, wandb_id(run_dir)):
        for payload in wandb_files.payloads(path):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(payload)
            if rec.WhichOneof("record_type") == "summary":
                out.update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in rec.summary.update})
    return out
