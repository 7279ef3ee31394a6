"""The ordering block (the seed's section 6): per-rank independent shuffles against the
global index + seed, measured on the real trainer.

"naive": every rank shuffles the whole dataset with its own seed (seed + rank) and takes
its micro-batches from the front of its own permutation, which is what a loader without
a global order does. "global": LoongForge's order (train/data/order.py), one order of
(seed, epoch) sliced across ranks. Both train the tiny recipe on the learnable sample data
(`loongforge sample-data --task learnable`) for 100 steps on 2 ranks, same seed and batch.
From the sample ids every rank actually trained: per epoch, how many samples were
trained more than once (duplicates) and how many never; and the loss of every step.

    loongforge bench ablation --order        # after the ladder
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.data import transcode
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.benchmarks.ablation.run import launch
from loongforge.benchmarks.ablation.rows import Setting, train_argv
from loongforge.benchmarks.harness.dataset import SampleTable, open_root

RANKS = 2
STEPS = 100
BATCH = 8


def learnable_config():
    # Small enough that 100 steps span several epochs, so per-epoch coverage is measured more than once.
    return BenchConfig(episodes=4, episode_frames=(60, 80), height=64, width=64, gop=10, gops=(10,),
                       shard_size="4MB", preprocess_workers=1, batch_size=BATCH)


def prepare_learnable(workdir: Path) -> str:
    bc = learnable_config()
    ds = generate_dataset(workdir / "learnable", episodes=bc.episodes, frames=bc.episode_frames, task="learnable",
                          seed=0)
    transcode(bc, Path(ds), workdir / "learnable-shards")
    return str(workdir / "learnable-shards")


def epoch_coverage(step_ids: list[list[list[int]]], train_ids: np.ndarray, steps_per_epoch: int) -> list[dict]:
    """Per complete epoch: samples trained, distinct, duplicated (extra copies) and never seen."""
    out = []
    for e in range(len(step_ids) // steps_per_epoch):
        ids = np.concatenate([np.ravel(s) for s in step_ids[e * steps_per_epoch:(e + 1) * steps_per_epoch]])
        distinct = np.unique(ids)
        out.append({"epoch": e, "trained": int(ids.size), "distinct": int(distinct.size),
                    "duplicated": int(ids.size - distinct.size),
                    "never_seen": int(np.setdiff1d(train_ids, distinct).size), "train_samples": int(train_ids.size)})
    return out


def _run_one(order: str, shards: str, workdir: Path) -> dict:
    run_dir = workdir / f"order-{order}"
    s, bc = Setting(loader="shards", workers=0, prefetch=2), learnable_config()
    argv = train_argv(s, shards=shards, run_dir=str(run_dir), recipe="tiny", batch=BATCH, steps=STEPS + 1,
                      seed=0, cuda=False, cache_socket=None, frames=bc.frames_per_sample, stride=bc.stride)
    spec = {"train_args": argv, "warmup": 1, "steps": STEPS - 1, "out": str(run_dir), "cuda": False,
            "order": order, "keep_ids": True, "probe_memory": False, "loader": "shards"}
    docs = launch(spec, RANKS, workdir, threads=1)
    return docs[0]


def train_sample_ids(root: str, stride: int) -> np.ndarray:
    """Sample ids of the training episodes (the split's other episodes left out), at `stride`."""
    ds = open_root(root)
    table = SampleTable(ds.episode_lengths, stride=stride)
    keep = table.keep_mask(~np.asarray(ds.val_mask, bool))
    return np.arange(table.num_samples) if keep is None else np.flatnonzero(keep)


def run_order(out_dir: Path, workdir: Path | None = None) -> tuple[dict, Path]:
    tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lf-order-")) if tmp else Path(workdir)
    t0 = time.perf_counter()
    try:
        shards = prepare_learnable(workdir)
        train_ids = train_sample_ids(shards, learnable_config().stride)
        per_epoch = train_ids.size // BATCH  # the uneven tail is dropped
        doc = {"kind": "ablation-order", "version": 1, "ranks": RANKS, "steps": STEPS, "global_batch": BATCH,
               "train_samples": int(train_ids.size), "steps_per_epoch": per_epoch, "runs": {}}
        for name in ("global", "naive"):
            r = _run_one(name, shards, workdir)
            doc["runs"][name] = {"losses": r["losses"],
                                 "epochs": epoch_coverage(r["sample_ids"], train_ids, per_epoch)}
    finally:
        if tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    doc["wall_s"] = time.perf_counter() - t0
    doc["load_avg_end"] = list(os.getloadavg())
    doc["tail_dropped_per_epoch"] = doc["train_samples"] - doc["steps_per_epoch"] * BATCH
    doc["summary"] = summary(doc)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ablation-order.json"
    doc["plot"] = plot(doc, path.with_suffix(".png"))
    path.write_text(json.dumps(doc, indent=1))
    return doc, path


def summary(doc: dict) -> str:
    tail = doc["train_samples"] - doc["steps_per_epoch"] * doc["global_batch"]
    lines = [f"| order | epochs | duplicated / epoch | never seen / epoch (of which the dropped tail: {tail}) | "
             "loss steps 1-10 | loss steps 91-100 |", "|---|---|---|---|---|---|"]
    for name, r in doc["runs"].items():
        ep, loss = r["epochs"], r["losses"]
        dup = np.mean([e["duplicated"] for e in ep]) if ep else float("nan")
        never = np.mean([e["never_seen"] for e in ep]) if ep else float("nan")
        n = doc["train_samples"]
        lines.append(f"| {name} | {len(ep)} | {dup:.1f} ({dup / n:.0%}) | {never:.1f} ({never / n:.0%}) | "
                     f"{np.mean(loss[:10]):.4f} | {np.mean(loss[-10:]):.4f} |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, r in doc["runs"].items():
        a.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_title(f"tiny recipe, learnable data, {doc['ranks']} ranks", fontsize=9)
    a.legend()
    names = list(doc["runs"])
    for i, key in enumerate(("duplicated", "never_seen")):
        vals = [np.mean([e[key] for e in doc["runs"][n]["epochs"]] or [0]) for n in names]
        b.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4, label=key.replace("_", " "))
    b.set_xticks([j + 0.2 for j in range(len(names))], names)
    b.set_ylabel(f"samples per epoch (of {doc['train_samples']})")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
