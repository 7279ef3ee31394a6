"""Validation: decode chosen samples exactly as training does, score the model on them.

`ValSet` holds a fixed set of validation samples (the index's held-out episodes) decoded once
into model batches on the device. `val_metrics` is what `--eval-every N` logs: the flow loss
(noise and time drawn from a fixed seed, so values are comparable across steps) and the MSE of
`predict_action` (4 Euler steps) against the ground truth, in normalised units, over valid rows.
"""

from __future__ import annotations

import numpy as np
import torch

from loongforge.shared.errors import ConfigError
from loongforge.shared.split import sample_episodes
from loongforge.train.data.batch import BatchLayout, Norm, bucket_for, default_buckets, fill_batch
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.sources import SourceSpec, close_source, make_source
from loongforge.train.model.build import build_model


def val_sample_ids(index, limit: int | None = None) -> np.ndarray:
    """Global sample numbers of the validation episodes, in (episode, time) order; `limit` picks an
    evenly spaced fixed subset."""
    val = np.asarray(index.val_episodes, np.int64)
    if not len(val):
        raise ConfigError("the index has no validation split; re-run preprocess with --val-episodes 10%")
    ids = np.flatnonzero(np.isin(sample_episodes(index), val))
    if limit is not None and len(ids) > limit:
        ids = ids[np.linspace(0, len(ids) - 1, limit).round().astype(np.int64)]
    return ids


class ValSet:
    """Decoded batches of chosen samples (on `device`, frames as model input)."""

    def __init__(self, root: str, index, ids: np.ndarray, *, batch_size: int = 8, text_len: int = 32,
                 device="cpu", image_mean: float = 0.5, image_std: float = 0.25, source: SourceSpec | None = None):
        self.index, self.ids, self.device = index, np.asarray(ids, np.int64), torch.device(device)
        self.norm = Norm.from_index(index)
        max_frames = max(max(s.frames) for s in index.shards)
        self.buckets = default_buckets(max_frames)
        self.conv = dict(matrix=index.dataset.color_matrix, color_range=index.dataset.color_range,
                         mean=image_mean, std=image_std)
        self.batches: list[dict] = []
        src = make_source(source or SourceSpec(root=root), index)
        try:
            for start in range(0, len(self.ids), batch_size):
                self.batches.append(self._decode(src, self.ids[start:start + batch_size], text_len))
        finally:
            close_source(src)

    def _decode(self, src, ids: np.ndarray, text_len: int) -> dict:
        items = [(int(g), *self.index.locate(int(g))) for g in ids]
        k = bucket_for(max(self.index.shards[s].frames[i] for _, s, i in items), self.buckets)
        layout = BatchLayout.from_index(self.index, len(items), text_len, k)
        buf = bytearray(layout.nbytes)
        arrays = layout.views(buf, k)
        fill_batch(src, self.index, layout, self.norm, arrays, items, "raise")
        out = {name: torch.from_numpy(a.copy()).to(self.device) for name, a in arrays.items()
               if not name.startswith("frames.")}
        out["frames"] = {s: nv12_to_input(torch.from_numpy(arrays[f"frames.{s}"].copy()).to(self.device),
                                          **self.conv) for s in layout.slots}
        return out


def _plain(model):
    """ZeRO-3 partitions parameters and its hooks release them after each forward, so inference
    outside the engine's forward cannot run on the engine's module: gather the weights (a collective:
    every rank evaluates) into a plain replica. Other stages hold whole parameters: used as is."""
    params = list(model.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return model
    import deepspeed  # heavy; only a ZeRO-3 run gets here

    with deepspeed.zero.GatheredParameters(params):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    replica = build_model(model.cfg)
    replica.load_state_dict(state)
    return replica.to(device=params[0].device, dtype=next(iter(state.values())).dtype)


def val_metrics(model, valset: ValSet, *, seed: int = 0, steps: int = 4) -> dict:
    """Validation flow loss and action MSE (normalised units) of `model` (a VLAModel)."""
    was_training, engine_module = model.training, model
    model = _plain(model)
    model.eval()
    flow, mse, n = 0.0, 0.0, 0.0
    g = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for i, batch in enumerate(valset.batches):
                shape = batch["action"].shape
                noise, u = torch.randn(shape, generator=g), torch.rand(shape[0], generator=g)
                out = model(batch, noise.to(valset.device), u.to(valset.device))
                w = (batch["action_valid"] & batch["sample_valid"][:, None]).float()
                pred = model.predict_action(batch, steps=steps, seed=seed + i)
                err = ((pred.float() - batch["action"].float()) ** 2).mean(-1)
                flow += float(out["flow_loss"]) * float(w.sum())
                mse += float((err * w).sum())
                n += float(w.sum())
    finally:
        engine_module.train(was_training)
    n = max(n, 1.0)
    return {"val_flow_loss": flow / n, "val_action_mse": mse / n}
