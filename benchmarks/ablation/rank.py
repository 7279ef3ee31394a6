"""One rank of one ablation row: the real `Trainer`, built from `loongforge train`
arguments, with two benchmark-only swaps applied from outside:

* `loader: pyav` replaces the ShardLoader with the on-the-fly PyAV decode loader
  (benchmarks/loader/baseline.py) over the LeRobot mp4 + parquet tree, serving the SAME
  global sample ids in the same order (the ShardLoader's own sequence), so every
  row trains on identical data;
* `prefetch: 0` turns the loader's async prefetch thread off (staging inline in
  next(), what a loader without a prefetch stage does).

Run as `python -m loongforge.benchmarks.ablation.rank SPEC.json` under the usual
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT environment (ablation.py launches the
ranks). Rank r writes `<out>/rank<r>.json`: per-step phase records after warm-up
and the activation bytes saved for backward of one extra probed step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

import numpy as np

log = logging.getLogger("loongforge.bench.ablation")


class BaselineLoader:
    """The PyAV decode-on-the-fly DataLoader behind the trainer's loader interface
    (iterator of batch dicts with "meta"; state_dict; bad_samples; close)."""

    def __init__(self, shard_loader, dataset_root: str, windows, *, num_workers: int):
        import torch

        from loongforge.benchmarks.loader.baseline import LeRobotVideoDataset
        from loongforge.benchmarks.loader.p3_rows import ModelInputs

        self.inner = shard_loader  # its order functions only: it never starts a worker pool here
        index = shard_loader.index
        cams = tuple((f"observation.images.{c.slot}", c.slot) for c in index.dataset.cameras)
        ds = LeRobotVideoDataset(dataset_root, list(windows), action_horizon=index.dataset.action_horizon,
                                 cameras=tuple(k for k, _ in cams), transform=ModelInputs(index, cams))
        self.metas = self._metas()
        self._dl = torch.utils.data.DataLoader(
            ds, batch_sampler=_IdBatches(self.metas), num_workers=num_workers, collate_fn=pad_collate,
            prefetch_factor=2 if num_workers else None, persistent_workers=False)
        self._it = None
        self.bad_samples = 0

    def _metas(self):
        """Per-step (epoch, consumed, ids) of this rank, exactly as the ShardLoader would serve them."""
        from loongforge.train.data import order_v1 as order

        sl = self.inner
        out, epoch, consumed = [], sl.epoch, sl.consumed
        for _ in range(4096):  # far more steps than any ablation row runs
            ids = order.rank_batch(sl.sequence(epoch), consumed, sl.global_batch, sl.rank, sl.world)
            out.append({"epoch": epoch, "consumed": consumed, "sample_ids": ids.copy()})
            epoch, consumed = order.advance(epoch, consumed, sl.plan)
        return out

    def __iter__(self):
        self._it = iter(self._dl)
        self._step = 0
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        batch["meta"] = dict(self.metas[self._step])
        self._step += 1
        return batch

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def close(self) -> None:
        self._it = None
        self.inner.close()


def pad_collate(items: list[dict]) -> dict:
    """Stack samples whose windows hold fewer frames (episode ends) by padding the frame axis
    with zeros, masked out in frame_mask, as the ShardLoader's length buckets do."""
    import torch

    k = max(int(it["frame_mask"].shape[0]) for it in items)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == k:
            return t
        return torch.cat([t, t.new_zeros((k - t.shape[0], *t.shape[1:]))])

    out = {"frames": {slot: torch.stack([pad(it["frames"][slot]) for it in items]) for slot in items[0]["frames"]},
           "state": torch.stack([pad(it["state"]) for it in items]),
           "frame_mask": torch.stack([pad(it["frame_mask"]) for it in items])}
    for key in items[0]:
        if key not in out:
            out[key] = torch.stack([it[key] for it in items])
    return out


class _IdBatches:
    """batch_sampler yielding each step's global sample ids (the dataset is indexed by them)."""

    def __init__(self, metas):
        self.metas = metas

    def __iter__(self):
        return (m["sample_ids"].tolist() for m in self.metas)

    def __len__(self) -> int:
        return len(self.metas)


def naive_order(loader, rank: int, seed: int) -> None:
    """What a naive loader does: every rank shuffles the whole dataset with its own seed
    (seed + rank) and takes its micro-batches from the front. Installed by replacing the
    loader's `sequence` so that this rank's slots of each global batch hold its own permutation."""
    per = loader.global_batch // loader.world
    n = len(loader.sequence(0))

    def sequence(epoch: int) -> np.ndarray:
        own = loader.subset_ids[np.random.default_rng([seed + rank, epoch]).permutation(n)]
        seq = np.empty(n, np.int64)
        steps = n // loader.global_batch
        for s in range(steps):
            at = s * loader.global_batch + np.arange(rank, loader.global_batch, loader.world)
            seq[at] = own[s * per:(s + 1) * per]
        seq[steps * loader.global_batch:] = own[steps * per:steps * per + n - steps * loader.global_batch]
        return seq

    loader.subset_ids = np.sort(loader.sequence(0))
    loader.sequence = sequence


def _probe_step(trainer, it) -> int:
    """Bytes autograd saves for backward in one more step (parameters excluded)."""
    import torch

    from loongforge.train.model.noise import noise_for

    e = trainer.engine
    probe = _activation_probe_class()(e.module)
    batch = next(it)
    meta = batch.pop("meta")
    noise, t = noise_for(trainer.cfg.data.seed, meta["epoch"], meta["sample_ids"], batch["action"].shape,
                         trainer.device)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with probe.forward():
        out = e(batch, noise, t)
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

    from loongforge.train.kernels.checkpointing import SavedBytesProbe

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

    from loongforge.train.flags import add_train_args, config_from_args
    from loongforge.train.observe.profiler import StepTimer
    from loongforge.train.trainer import Trainer

    p = argparse.ArgumentParser()
    add_train_args(p)
    cfg = config_from_args(p.parse_args(spec["train_args"]))
    trainer = Trainer(cfg)
    try:
        if spec.get("order") == "naive":
            naive_order(trainer.loader, trainer.data_rank, cfg.data.seed)
        if spec.get("loader") == "pyav":
            trainer.loader = BaselineLoader(trainer.loader, spec["dataset"], _windows(spec["windows"]),
                                            num_workers=cfg.data.num_workers)
        elif "prefetch" in spec:
            trainer.loader.prefetch = int(spec["prefetch"])  # 0 = no prefetch thread (Prefetcher is inline)
        timer, it, records, losses, ids = StepTimer(trainer.device), iter(trainer.loader), [], [], []
        for step in range(spec["warmup"] + spec["steps"]):
            trainer.step = step
            timing, rec = trainer._one_step(it, timer)
            if step >= spec["warmup"]:
                records.append({**StepTimer.finish(timing), "comm_groups": rec.get("comm_groups")})
            losses.append(rec["loss"])
            ids.append(rec["sample_ids"])  # every replica's ids of this step (TP copies dropped)
        saved = _probe_step(trainer, it) if spec.get("probe_memory", True) else None
        return {"rank": trainer.rank, "world": trainer.world, "records": records, "losses": losses,
                "sample_ids": ids if spec.get("keep_ids") else None,
                "saved_bytes": saved, "params": trainer.params, "torch_threads": torch.get_num_threads()}
    finally:
        trainer.close()


def _windows(rows):
    from loongforge.benchmarks.loader.baseline import Window

    return [Window(int(e), tuple(int(f) for f in fr)) for e, fr in rows]


def main(argv: list[str] | None = None) -> None:
    from loongforge.train.parallel import engine
    from loongforge.train.resilience.exits import exit_now

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
