"""One rank of one ablation row: the real `Trainer`, built from `loongforge train`
arguments, with two benchmark-only swaps applied from outside:

* `loader: pyav` replaces the trainer's loader with the on-the-fly PyAV decode loader
  (benchmarks/loader/baseline.py) over the LeRobot mp4 + parquet tree, serving the SAME
  samples in the same order: per step, the sample ids the trainer's loader would serve
  (its own plan: global order, rank slice, epoch roll-over), each decoded at the same
  (episode, t) with the same video deltas and action horizon, so every row trains on
  identical data and differs only in the optimisation it adds;
* `prefetch: 0` turns the loader's async prefetch thread off (staging inline in
  next(), what a loader without a prefetch stage does).

Run as `python -m loongforge.benchmarks.ablation.rank SPEC.json` under the usual
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT environment (ablation/run.py launches the
ranks). Rank r writes `<out>/rank<r>.json`: per-step phase records after warm-up
and the activation bytes saved for backward of one extra probed step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import traceback

import numpy as np
from loongforge.benchmarks.harness.data import windows_of
from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset
from loongforge.benchmarks.loader.p3_rows import ModelInputs
from loongforge.train.model.noise import noise_for
from loongforge.train.kernels.checkpointing import SavedBytesProbe
from loongforge.train.flags import add_train_args, config_from_args
from loongforge.train.observe.profiler import StepTimer
from loongforge.train.trainer import Trainer
from loongforge.train.parallel import engine
from loongforge.train.resilience.exits import exit_now

log = logging.getLogger("loongforge.bench.ablation")


class BaselineLoader:
    """The PyAV decode-on-the-fly DataLoader behind the trainer's loader interface (iterator of
    batch dicts with "meta"; state_dict; bad_samples; close), serving `steps` steps of the
    samples the trainer's loader `loader` would serve."""

    def __init__(self, loader, dataset_root: str, *, num_workers: int, steps: int):
        import torch


        self.inner = loader  # its plan only: it never starts a worker pool here
        info = loader.ds.info
        cams = tuple((c.key, c.slot) for c in info.cameras)
        # Sample id i of the loader's table -> (source episode, t, frames at its video deltas)
        windows = windows_of(loader.ds.root, loader.deltas, loader.stride)
        ds = LeRobotVideoDataset(dataset_root, list(windows), action_horizon=loader.deltas.action_horizon,
                                 cameras=tuple(k for k, _ in cams),
                                 transform=ModelInputs(info, cams, prompts=loader.prompts))
        # The loader's own per-step plan (epoch, in-epoch position, this rank's sample ids), as it serves it.
        self.metas = [meta for meta, _ in itertools.islice(loader.plans(), steps)]
        self._dl = torch.utils.data.DataLoader(ds, batch_sampler=_IdBatches(self.metas), num_workers=num_workers,
                                               prefetch_factor=2 if num_workers else None, persistent_workers=False)
        self._it = None
        self.bad_samples = 0

    def __iter__(self):
        self._it = iter(self._dl)
        self._step = 0
        return self

    def __next__(self) -> dict:
        batch = _to(next(self._it), self.inner.device)  # where the trainer's loader puts its batches
        meta = dict(self.metas[self._step])
        batch["sample_ids"] = _to(torch_ids(meta["sample_ids"]), self.inner.device)
        batch["meta"] = meta
        self.inner.epoch, self.inner.consumed = meta["next_epoch"], meta["next_consumed"]  # its state_dict follows
        self.inner.steps_done = meta["step"] + 1
        self._step += 1
        return batch

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def close(self) -> None:
        self._it = None
        self.inner.close()


def torch_ids(ids: np.ndarray):
    import torch

    return torch.from_numpy(np.asarray(ids, np.int64).copy())


def _to(x, device):
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x.to(device, non_blocking=True) if hasattr(x, "to") else x


class _IdBatches:
    """batch_sampler yielding each step's sample ids (the dataset is indexed by them)."""

    def __init__(self, metas):
        self.metas = metas

    def __iter__(self):
        return (m["sample_ids"].tolist() for m in self.metas)

    def __len__(self) -> int:
        return len(self.metas)


class NaiveOrder:
    """What a loader without a global order does: every rank permutes the whole training set
    with its own seed (seed + rank) and takes its micro-batches from the front of it."""

    def __init__(self, train_ids: np.ndarray, seed: int, rank: int, epoch: int):
        self.own = train_ids[np.random.default_rng([seed + rank, epoch]).permutation(len(train_ids))]
        self.num_samples = len(train_ids)

    def rank_ids(self, consumed: int, global_batch: int, rank: int, world: int) -> np.ndarray:
        per = global_batch // world
        step = consumed // global_batch
        return self.own[step * per:(step + 1) * per]


def naive_order(loader, rank: int, seed: int) -> None:
    """Install NaiveOrder as the loader's epoch order (its plan reads `epoch_order(epoch).rank_ids`)."""
    train_ids = np.sort(loader.sequence(0))
    loader.epoch_order = lambda epoch: NaiveOrder(train_ids, seed, rank, epoch)


def _probe_step(trainer, it) -> int:
    """Bytes autograd saves for backward in one more step (parameters excluded)."""
    import torch


    e = trainer.engine
    probe = _activation_probe_class()(e.module)
    batch = next(it)
    meta = batch.pop("meta")
    b = batch["action"].shape[0]
    root = trainer.index.roots[meta.get("dataset", 0)]
    noise, u, _ = noise_for(trainer.cfg.data.seed, meta["epoch"], meta["sample_ids"],
                            (b, trainer.model_cfg.action_horizon, trainer.model_cfg.max_action_dim), trainer.device)
    draws = trainer.processor.draws(trainer.cfg.data.seed, meta["epoch"], meta["sample_ids"])
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with probe.forward():
        out = e(trainer.processor(batch, root.tag, root.cameras, draws=draws), noise, u)
    with probe.backward():
        e.backward(out["loss"])
        if trainer.dp_sync is not None:
            trainer.dp_sync()
    e.step()
    if trainer.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return probe.saved_bytes


def _activation_probe_class():
    import torch


    class Probe(SavedBytesProbe):
        # NOTE: under ZeRO-3 a gathered weight is saved by the linear's autograd function; it is a
        # parameter, not an activation, whatever its storage.
        def _add(self, t):
            if isinstance(t, torch.nn.Parameter):
                return
            super()._add(t)

    return Probe


def run_rank(spec: dict) -> dict:
    import torch


    p = argparse.ArgumentParser()
    add_train_args(p)
    cfg = config_from_args(p.parse_args(spec["train_args"]))
    trainer = Trainer(cfg)
    try:
        if spec.get("order") == "naive":
            naive_order(trainer.loader, trainer.data_rank, cfg.data.seed)
        if spec.get("loader") == "pyav":
            trainer.loader = BaselineLoader(trainer.loader, spec["dataset"], num_workers=cfg.data.num_workers,
                                            steps=spec["warmup"] + spec["steps"] + 1)  # + the probed step
        elif "prefetch" in spec:
            trainer.loader.prefetch = int(spec["prefetch"])  # 0 = no prefetch thread (Prefetcher is inline)
        timer, it, records, losses, ids = StepTimer(trainer.device), iter(trainer.loader), [], [], []
        for step in range(spec["warmup"] + spec["steps"]):
            trainer.step = step
            timing, rec = trainer._one_step(it, timer)
            if step >= spec["warmup"]:
                records.append({**StepTimer.finish(timing), "comm_groups": rec.get("comm_groups")})
            every_dev, replicas = rec["_device"]  # the step's losses, every replica's (read on the host now)
            losses.append(float(every_dev.cpu()[replicas][:, 0].mean()))
            ids.append(rec["sample_ids"])  # every replica's ids of this step (TP copies dropped)
        saved = _probe_step(trainer, it) if spec.get("probe_memory", True) else None
        return {"rank": trainer.rank, "world": trainer.world, "records": records, "losses": losses,
                "sample_ids": ids if spec.get("keep_ids") else None,
                "saved_bytes": saved, "params": trainer.params, "torch_threads": torch.get_num_threads()}
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser().parse_known_args(argv)[1]
    spec = json.loads(open(args[0]).read())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    code = 0
    try:
        doc = run_rank(spec)
        path = os.path.join(spec["out"], f"rank{doc['rank']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
    except BaseException:  # noqa: BLE001 - print it; the harness reports the row as failed
        traceback.print_exc()
        code = 1
    finally:
        try:
            engine.shutdown(barrier=code == 0)
        except Exception as exc:  # noqa: BLE001
            print(f"process group teardown: {exc}", file=sys.stderr)
    exit_now(code)


if __name__ == "__main__":
    main()
