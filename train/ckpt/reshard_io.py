"""File side of the resharding converter (reshard.py): trusted loads, DeepSpeed's
metadata for the target layout, and publishing the new tag (sidecar, manifest, then `latest`).

What DeepSpeed's load_universal path reads from one target folder `universal_tpXX/`:
    zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": tensor} of this TP rank's shape
    zero/<param>/step.pt                        the Adam step (ZeRO-1/2 read it per parameter)
    zero/optimizer_state.pt                     loss scaler, clip, param groups (lr, betas, ...);
                                                ZeRO-3 reads the step from its state[0]
    mp_rank_XX_model_states.pt (ZeRO-1/2) and zero_pp_rank_0_mp_rank_XX_model_states.pt (ZeRO-3):
        metadata only (LR scheduler, global step/samples, client state); the universal path
        never reads its `module`, so the weights are not duplicated there.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.shared.storage import sha256_file, write_bytes_atomic
from loongforge.train.ckpt.files import MANIFEST, MANIFEST_VERSION, SIDECAR, load_trusted

RESHARD_VERSION = 1
# The model-states names DeepSpeed's loader globs for, ZeRO-1/2 and ZeRO-3 (any mp rank: one file per folder).
# Both are written (metadata only, a few KB), so the folder loads into any ZeRO stage 1-3.
META_NAMES = ("mp_rank_{tp:02d}_model_states.pt", "zero_pp_rank_0_mp_rank_{tp:02d}_model_states.pt")
_DROP_META = ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments")


def save_tensor_file(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)


def source_meta(src: str) -> dict:
    """DeepSpeed's model-states dict of the source without the weights (they come from the optimizer's fp32)."""
    names = sorted(glob.glob(os.path.join(src, "mp_rank_00_model_states.pt")) +
                   glob.glob(os.path.join(src, "zero_pp_rank_0_mp_rank_00_model_states.pt")))
    if not names:
        raise CheckpointError(f"{src}: no mp_rank_00 model-states file; not a DeepSpeed checkpoint directory")
    meta = load_trusted(names[0])
    meta.pop("module", None)
    meta.pop("optimizer", None)  # ZeRO-0: the torch optimizer state, carried per parameter instead
    return meta


def read_step(udir: str, meta: dict) -> int:
    """The Adam step: ZeRO-3 sources keep it in optimizer_state.pt, ZeRO-1/2 per parameter."""
    optim = load_trusted(os.path.join(udir, "zero", "optimizer_state.pt"))
    state = optim.get("optimizer_state_dict", {}).get("state", {})
    if state and "step" in state.get(0, {}):
        return int(state[0]["step"])
    for path in sorted(glob.glob(os.path.join(udir, "zero", "*", "step.pt")))[:1]:
        return int(load_trusted(path))
    return int(meta["global_steps"]) - int(meta.get("skipped_steps", 0))


def _param_groups(src_optim: dict) -> list[dict]:
    groups = src_optim.get("param_groups") or src_optim.get("optimizer_state_dict", {}).get("param_groups")
    if not groups:
        raise CheckpointError("universal optimizer_state.pt has no param_groups (lr, betas, eps, weight decay)")
    return [{**g, "params": []} for g in groups]


def target_optimizer_state(src_optim: dict, meta: dict, *, step: int, target) -> dict:
    """One optimizer_state.pt that DeepSpeed's universal loaders of ZeRO-1/2 (loss scaler, clip_grad,
    ds_version, param groups) and of ZeRO-3 (optimizer_state_dict with the step in state[0]) both read,
    so the folder loads into any ZeRO stage 1-3 and any DP degree."""
    from deepspeed.runtime.zero.config import ZeroStageEnum  # heavy; the converter's child process only

    groups = _param_groups(src_optim)
    out = {k: src_optim[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow") if k in src_optim}
    clip = src_optim.get("clip_grad", meta.get("ds_config", {}).get("gradient_clipping", 0.0))
    out.update({"zero_stage": ZeroStageEnum(target.zero), "partition_count": target.dp, "param_groups": groups,
                "clip_grad": float(clip), "ds_version": src_optim.get("ds_version") or meta["ds_version"],
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": groups}})
    return out


def target_meta(meta: dict, target) -> dict:
    out = {k: copy.deepcopy(v) for k, v in meta.items() if k not in _DROP_META}
    out["module"] = {}
    # NOTE: mp_world_size 1: each universal_tpXX/ folder holds one model-states file, and DeepSpeed's state-dict
    # loader asserts that the file count equals the saved mp_world_size; the TP degree is in the sidecar.
    out["dp_world_size"], out["mp_world_size"] = target.dp, 1
    out["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": target.tp}
    return out


def publish(root: str, out_dir: str, tag: str, doc: dict, *, move_latest: bool = True) -> None:
    """Sidecar and manifest into out_dir, move it to root/tag, then `latest` (last, atomically): a crash
    before that leaves the previous `latest` in place. move_latest=False: the caller verifies the new tag
    first and moves `latest` itself (resilience/elastic/reshard.py)."""
    with open(os.path.join(out_dir, SIDECAR), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    files = {}
    for dirpath, _, names in os.walk(out_dir):
        for name in names:
            path = os.path.join(dirpath, name)
            sha, n = sha256_file(path)
            files[os.path.relpath(path, out_dir)] = {"bytes": n, "sha256": sha}
    manifest = {"format": "loongforge-checkpoint-manifest", "format_version": MANIFEST_VERSION, "tag": tag,
                "world": doc["world"], "files": files, "bases": []}
    write_bytes_atomic(os.path.join(out_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = os.path.join(root, tag)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out_dir, final)
    if move_latest:
        write_bytes_atomic(os.path.join(root, "latest"), tag.encode())


def load_tag_dir(doc: dict, tag: str, rank: int) -> str | None:
    """For checkpoint.load: the universal folder (relative to the checkpoint root) this rank loads from a
    resharded checkpoint, or None for an ordinary one. TP is innermost in the rank placement (plan.py)."""
    info = doc.get("resharded")
    if not info:
        return None
    if info.get("version") != RESHARD_VERSION:
        raise CheckpointError(f"checkpoint {tag} was resharded with format version {info.get('version')!r}, this "
                              f"build reads {RESHARD_VERSION}; reshard it again with this LoongForge version")
    if info.get("dir") is None:  # resharded into ordinary ZeRO-0 files (reshard_zero0.py): a normal load
        return None
    tp = int(doc.get("parallel", {}).get("tp", 1))
    return os.path.join(tag, info["dir"].format(tp=rank % tp))
