"""Frozen parameters through a reshard (reshard.py).

DeepSpeed's universal format holds what the optimizer owns; a fine-tune freezes most of N1.6 (the
vision tower, the LLM below its top layers: train/model/model.py set_trainable), and the vision
pooling head never trains. Their values live elsewhere in a DeepSpeed checkpoint:

    ZeRO-0/1/2  mp_rank_XX_model_states.pt            "module": every parameter whole (TP-local)
    ZeRO-3      zero_pp_rank_D_mp_rank_XX_model_states.pt  "frozen_param_shapes" and
                "frozen_param_fragments": rank D's flat partition of each frozen parameter

`collect` merges them to full (TP-1) tensors and the resharded tag keeps them in one file,
`frozen.pt` ({name: tensor}); a ZeRO-0 target takes them into its module dict
(reshard_zero0.py), a ZeRO-1/2/3 target gets them copied in after DeepSpeed's universal load
(`restore`), so the resumed model holds exactly what the source run held.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt.files import load_trusted

FROZEN_FILE = "frozen.pt"


def _zero3_files(src: str, t: int) -> list[str]:
    files = glob.glob(os.path.join(src, f"zero_pp_rank_*_mp_rank_{t:02d}_model_states.pt"))
    return sorted(files, key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(p)).group(1)))


def _tp_local(src: str, t: int, names: list[str]) -> dict[str, torch.Tensor]:
    """TP rank t's values of `names` from the source folder, in their TP-local shapes."""
    whole = os.path.join(src, f"mp_rank_{t:02d}_model_states.pt")
    parts = _zero3_files(src, t)
    if os.path.exists(whole) and not parts:
        module = load_trusted(whole).get("module") or {}
        return {n: module[n] for n in names if n in module}
    out: dict[str, torch.Tensor] = {}
    states = [load_trusted(p) for p in parts]
    shapes = (states[0].get("frozen_param_shapes") or {}) if states else {}
    for n in names:
        if n not in shapes:
            continue
        frags = [s["frozen_param_fragments"][n].reshape(-1) for s in states]
        shape = torch.Size(shapes[n])
        out[n] = torch.cat(frags)[:shape.numel()].reshape(shape).clone()
    return out


def collect(src: str, names: list[str], tp: int, merge) -> dict[str, torch.Tensor]:
    """Full tensors of the frozen parameters `names` from a DeepSpeed checkpoint folder with `tp` TP
    ranks; `merge(parts, name)` joins one parameter's TP shards. A missing one is a CheckpointError."""
    per_rank = [_tp_local(src, t, names) for t in range(tp)]
    missing = [n for n in names if any(n not in r for r in per_rank)]
    if missing:
        raise CheckpointError(f"{src}: the frozen parameters {missing[:5]} are in neither the module states nor "
                              "ZeRO-3's frozen fragments; not a checkpoint of this model")
    return {n: merge([r[n] for r in per_rank], n) for n in names}


def restore(engine, path: str, split) -> int:
    """Copy the resharded tag's frozen parameters into the engine's module (ZeRO-3: into each rank's
    partition, through a gather); `split(full, name)` cuts this TP rank's shard. Returns the count."""
    if not os.path.exists(path):
        return 0
    frozen = load_trusted(path)
    params = {n: p for n, p in engine.module.named_parameters() if n in frozen}
    if set(params) != set(frozen):
        raise CheckpointError(f"{path}: frozen parameters {sorted(set(frozen) - set(params))[:5]} are not in this "
                              "model")
    partitioned = [p for p in params.values() if hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed  # heavy; only a ZeRO-3 resume gets here

        ctx = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)
    else:
        ctx = contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for n, p in params.items():
            p.data.copy_(split(frozen[n], n).to(p.dtype))
    return len(params)
