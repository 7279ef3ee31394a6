"""Validation: decode chosen samples exactly as training does, score the model on them.

`ValSet` holds a fixed set of validation samples (the index's held-out episodes) decoded once
into loader batches on the device, with the run's prompts and processor (centred crops, as N1.6
evaluates), the raw state and action riding along (the open-loop eval decodes to robot units with
them). `val_metrics` is what `--eval-every N` logs: the flow loss (noise and time drawn from a
fixed seed, so values are comparable across steps) and the MSE of `get_action` (4 Euler steps)
against the target, in normalised units, over valid rows and the data's action dims.
"""

from __future__ import annotations

import numpy as np
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.fill import BlockFiller
from loongforge.train.data.processor import Processor
from loongforge.train.data.prompt import PromptTable
from loongforge.train.data.samples import SampleTable, sample_lengths
from loongforge.train.data.training_data import TrainingData
from loongforge.train.model.build import build_model


def val_sample_ids(data: TrainingData, limit: int, stride: int = 1) -> np.ndarray:
    """Sample ids (stride-1 numbering) of the held-out episodes, every `stride`-th t, evenly
    thinned to `limit`: the fixed subset --eval-every scores."""
    table = SampleTable(sample_lengths(data.ds.episode_lengths, data.deltas))
    val = np.asarray(data.ds.val_mask, bool)
    if not val.any():
        raise ConfigError("the index has no validation split; re-run preprocess with --val-episodes 10%")
    ids = np.flatnonzero(table.keep_mask(val))
    ids = ids[table.locate(ids)[1] % stride == 0]
    if limit and len(ids) > limit:
        ids = ids[np.linspace(0, len(ids) - 1, limit).round().astype(np.int64)]
    return ids


class ValSet:
    """Decoded batches of chosen samples (stride-1 ids), on `device`, frames normalized as the model's
    processor wants them; `inputs(batch)` turns one into the model's inputs."""

    def __init__(self, data: TrainingData, ids: np.ndarray, prompts: PromptTable, processor: Processor, *,
                 batch_size: int = 8, device="cpu"):
        root = data.roots[0]
        ds, info = root.ds, root.dataset
        table = SampleTable(sample_lengths(ds.episode_lengths, root.deltas))
        ids = np.asarray(ids, np.int64)
        self.ids, self.device, self.processor = ids, torch.device(device), processor
        self.tag, self.cameras = root.tag, root.cameras
        sa = processor.state_action(root.tag)
        conv = dict(matrix=info.color_matrix, color_range=info.color_range, mean=processor.cfg.image_mean,
                    std=processor.cfg.image_std)
        sizes = tuple(info.camera_size(i) for i in range(len(info.cameras)))
        self.batches = []
        for start in range(0, len(ids), batch_size):
            chunk = ids[start:start + batch_size]
            layout = BatchLayout(len(chunk), tuple(info.slots), info.height, info.width, root.deltas.frames,
                                 sa.state_dim, sa.action_dim, root.deltas.action_horizon, prompts.length,
                                 sizes=sizes, raw_state_dim=sa.raw_state_dim, raw_action_dim=sa.action_dim)
            arrays = layout.views(bytearray(layout.nbytes))
            eps, ts = table.locate(chunk)
            BlockFiller(ds, root.deltas, layout, 0, prompts, sa, root.keys).fill(
                arrays, list(zip(chunk.tolist(), eps.tolist(), ts.tolist())), "raise")
            out = {n: torch.from_numpy(a.copy()).to(self.device) for n, a in arrays.items()
                   if not n.startswith("frames.")}
            out["frames"] = {s: nv12_to_input(torch.from_numpy(arrays[f"frames.{s}"].copy()).to(self.device), **conv)
                             for s in layout.slots}
            self.batches.append(out)

    def inputs(self, batch: dict) -> dict:
        return self.processor(batch, self.tag, self.cameras, None)  # centred crops: N1.6's evaluation transform


def predict(model, inputs: dict, *, horizon: int, action_dim: int, steps: int, seed: int) -> torch.Tensor:
    """(B, horizon, action_dim) normalized actions: `steps` Euler steps from noise seeded by `seed`
    (drawn on the CPU: the same actions on every device)."""
    with torch.no_grad():
        cond = model.encode(inputs)
    return sample_flow(model, cond, inputs, horizon=horizon, action_dim=action_dim, steps=steps, seed=seed)


def sample_flow(model, cond: dict, inputs: dict, *, horizon: int, action_dim: int, steps: int,
                seed: int) -> torch.Tensor:
    """`predict` from the backbone's conditioning `cond` (model.encode(inputs)), computed once for several seeds."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((inputs["state"].shape[0], horizon, model.cfg.max_action_dim), generator=g)
    with torch.no_grad():
        out = model.action_head.sample(cond, noise.to(inputs["state"].device), steps).float()
    return out[..., :action_dim]


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
    """Validation flow loss and action MSE (normalised units) of `model` (a Gr00tN1d6)."""
    was_training, engine_module = model.training, model
    model = _plain(model)
    model.eval()
    flow, mse, n = 0.0, 0.0, 0.0
    g = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for i, batch in enumerate(valset.batches):
                inputs = valset.inputs(batch)
                b, h, da = batch["action"].shape
                noise = torch.randn((b, model.cfg.action_horizon, model.cfg.max_action_dim), generator=g)
                u = torch.rand(b, generator=g)
                out = model(inputs, noise.to(valset.device), u.to(valset.device))
                w = (batch["action_valid"] & batch["sample_valid"][:, None]).float()
                pred = predict(model, inputs, horizon=model.cfg.action_horizon, action_dim=da, steps=steps,
                               seed=seed + i)[:, :h]
                err = ((pred.float() - batch["action"].float()) ** 2).mean(-1)
                flow += float(out["flow_loss"]) * float(w.sum())
                mse += float((err * w).sum())
                n += float(w.sum())
    finally:
        engine_module.train(was_training)
    n = max(n, 1.0)
    return {"val_flow_loss": flow / n, "val_action_mse": mse / n}
