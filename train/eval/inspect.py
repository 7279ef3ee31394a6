"""`loongforge inspect ROOT --at EPISODE:FRAME ... --npz OUT`: samples exactly as the model receives them.

Each (source episode id, frame) goes through the run's path: the decode worker's filler (N1.6's state
and action processing, processor.py / state_action.py), then the processor's model inputs (padding to
max_state_dim / max_action_dim / max_action_horizon, the action mask, the chat-template prompt, the
embodiment id, pixel values). Evaluation mode (centred crop) unless --train, whose crop and colour
jitter are the draws training makes for that sample at that seed (processor.draws, data/images.py). The model's
settings are a recipe's (default: the released N1.6's, whose processor pads to 128 / 128 / 50 and
makes 252 x 252 images; padded as the released checkpoint's processor pads, 128 / 128 / 50), a
checkpoint's (--init-from) or a trained run's (--run).

The npz holds the names Isaac-GR00T's collator emits (state, action, action_mask, embodiment_id,
input_ids, attention_mask, image_sizes, pixel_values: the device path training runs) and beside them
`pixel_values_uint8` from the reference path (OpenCV + Pillow on the decoder's RGB: Isaac-GR00T's
pixels exactly) and the raw arrays (raw_state, raw_action in key order, images_raw.<video key> as the
decoder's RGB), so a user can look at what trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loongforge.shared.errors import UsageError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.fill import BlockFiller
from loongforge.train.data.images import reference_pixels, reference_rgb
from loongforge.train.data.processor import Processor
from loongforge.train.data.prompt import build_prompts, load_tokenizer
from loongforge.train.data.samples import SampleTable, sample_lengths
from loongforge.train.data.training_data import load_for_policy, load_training_data
from loongforge.train.model.config import model_config_from
from loongforge.train.recipes import plan_model


def parse_at(values: list[str]) -> list[tuple[int, int]]:
    out = []
    for v in values:
        try:
            e, f = v.split(":")
            out.append((int(e), int(f)))
        except ValueError:
            raise UsageError(f"--at {v!r}: give EPISODE:FRAME, e.g. 0:8 (the source episode id and frame)") from None
    return out


@dataclass(frozen=True)
class _Plan:
    processor: Processor
    prompts: tuple


def plan_for(root: str, *, recipe: str = "gr00t-n1.6", init_from: str | None = None, tokenizer: str | None = None,
             run: str | None = None):
    """(TrainingData, a plan with .processor and .prompts): a trained run's recorded processor and tokenizer
    (the latest checkpoint's), or what a run of `recipe` / `--init-from` on this root would train with."""
    if run is None:
        data = load_training_data(DataConfig(root=root))
        cfg = TrainConfig(recipe=recipe if init_from is None else "gr00t-n1.6", data=DataConfig(root=root),
                          model=ModelConfig(init_from=init_from, tokenizer=tokenizer), run=RunConfig(run_dir=root))
        return data, plan_model(cfg, data)
    tag = ckpt_files.latest_tag(run)
    if tag is None:
        raise UsageError(f"--run {run}: no checkpoint under {ckpt_files.ckpt_root(run)}")
    doc = ckpt_files.read_sidecar(run, tag)
    if "gr00t_processor" not in doc:
        raise UsageError(f"--run {run}: its checkpoint records no N1.6 processor (written by an older version)")
    model = model_config_from(doc)
    data = load_for_policy(root, doc, model.action_horizon)
    r = data.roots[0]
    tok = load_tokenizer(tokenizer or doc.get("tokenizer"), model.image_token_index)
    prompts = build_prompts(tok, r.dataset.tasks or {}, images=len(r.cameras) * r.deltas.frames,
                            tokens_per_image=model.tokens_per_image(*Processor.from_json(
                                doc["gr00t_processor"]).cfg.image_size), vocab_size=model.text.vocab_size)
    return data, _Plan(Processor.from_json(doc["gr00t_processor"]), (prompts,))


# The released N1.6 checkpoint's processor pads to these (its processor_config.json); a from-scratch recipe
# pads to its own model's sizes, which fit the data.
RELEASED_PADDING = (128, 128, 50)


def samples(root: str, at: list[tuple[int, int]], *, train: bool = False, seed: int = 0,
            padding: tuple[int, int, int] | None = None, **plan_kw) -> dict:
    """The npz's arrays for the samples `at` = [(source episode id, frame)]; `padding` (state dims, action
    dims, action steps) replaces the model's (RELEASED_PADDING: what the released N1.6 pads to)."""
    data, plan = plan_for(root, **plan_kw)
    r = data.roots[0]
    proc = plan.processor
    if padding is not None:
        proc = Processor(proc.cfg, proc.embodiments, max_state_dim=padding[0], max_action_dim=padding[1],
                         max_action_horizon=padding[2])
    sa = proc.state_action(r.tag)
    ids = np.asarray(r.ds.tables["episode_id"])
    table = SampleTable(sample_lengths(r.ds.episode_lengths, r.deltas))
    items = []
    for e, f in at:
        rows = np.flatnonzero(ids == e)
        if not len(rows):
            raise UsageError(f"--at {e}:{f}: no episode {e} in {root} (episodes {ids.min()}..{ids.max()})")
        row = int(rows[0])
        if not 0 <= f < table.lengths[row]:
            raise UsageError(f"--at {e}:{f}: episode {e} has samples at frames 0..{int(table.lengths[row]) - 1} "
                             f"(its {int(r.ds.episode_lengths[row])} frames less the {r.deltas.action_horizon}-step "
                             "action chunk)")
        items.append((table.sample_id(row, f), row, f))
    info = r.dataset
    sizes = tuple(info.camera_size(i) for i in range(len(info.cameras)))
    layout = BatchLayout(len(items), tuple(info.slots), info.height, info.width, r.deltas.frames, sa.state_dim,
                         sa.action_dim, r.deltas.action_horizon, plan.prompts[0].length, sizes=sizes,
                         raw_state_dim=sa.raw_state_dim, raw_action_dim=sa.action_dim)
    arrays = layout.views(bytearray(layout.nbytes))
    BlockFiller(r.ds, r.deltas, layout, 0, plan.prompts[0], sa, r.keys).fill(arrays, items, "raise")
    pc = proc.cfg
    batch = {n: torch.from_numpy(a.copy()) for n, a in arrays.items() if not n.startswith("frames.")}
    batch["frames"] = {s: nv12_to_input(torch.from_numpy(arrays[f"frames.{s}"].copy()), info.color_matrix,
                                        info.color_range, mean=pc.image_mean, std=pc.image_std) for s in info.slots}
    draws = proc.draws(seed, 0, [i[0] for i in items]) if train else None  # as training draws them (epoch 0)
    inputs = proc(batch, r.tag, r.cameras, draws=draws)
    keep = inputs["attention_mask"].bool().any(0)  # the batch's own left padding (the collator's)
    first = int(np.argmax(keep.numpy())) if keep.any() else 0
    out = {"state": inputs["state"].numpy(), "action": inputs["action"].numpy(),
           "action_mask": inputs["action_mask"].numpy(), "embodiment_id": inputs["embodiment_id"].numpy(),
           "input_ids": inputs["input_ids"][:, first:].numpy(),
           "attention_mask": inputs["attention_mask"][:, first:].long().numpy(),
           "pixel_values": inputs["pixel_values"].numpy(),
           "image_sizes": np.tile(np.asarray(inputs["pixel_values"].shape[-2:], np.int64),
                                  (inputs["pixel_values"].shape[0], 1)),
           "raw_state": arrays["raw_state"].copy(), "raw_action": arrays["raw_action"].copy(),
           "sample_ids": np.asarray([i[0] for i in items], np.int64)}
    # The reference path beside the trained one: the decoder's RGB from the stored planes (swscale, as
    # Isaac-GR00T's torchcodec decodes), OpenCV + Pillow on uint8: Isaac-GR00T's pixels bit for bit.
    ref = []
    for i in range(len(items)):
        offset, jit = draws.sample(i) if draws is not None else (None, None)
        for k in range(r.deltas.frames):  # frame-major, then camera, as the model stacks them
            for key in sa.config.video.modality_keys:
                rgb = reference_rgb(arrays[f"frames.{r.keys['video'][key]}"][i, k], info.color_matrix,
                                    info.color_range)
                ref.append(reference_pixels(rgb, pc.geometry, offset=offset, jitter=jit))
    out["pixel_values_uint8"] = np.stack(ref)
    for key in sa.config.video.modality_keys:
        slot = r.keys["video"][key]
        out[f"images_raw.{key}"] = np.stack([reference_rgb(f, info.color_matrix, info.color_range)
                                             for f in arrays[f"frames.{slot}"][:, -1]])
    return out
