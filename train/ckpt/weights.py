"""A run's model weights as one fp32 state dict, from any of its DeepSpeed checkpoints.

ZeRO-1/2/3 checkpoints are consolidated with DeepSpeed's zero_to_fp32 (frozen parameters included:
DeepSpeed stores their fragments beside the optimizer's), ZeRO-0 ones read from the module state
file; every torch.load inside is forced weights-only. Policy (eval/policy.py) and export
(ckpt/export.py) read weights through here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import files as ckpt_files

log = logging.getLogger(__name__)


def load_weights(run_dir: str, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    """fp32 state dict of the model from a DeepSpeed checkpoint directory (one TP rank's files: a
    tensor-parallel or universal-format checkpoint is refused with the converting command)."""
    tag_dir = os.path.join(ckpt_files.ckpt_root(run_dir), tag)
    doc = ckpt_files.read_sidecar(run_dir, tag)
    tp = int(doc.get("parallel", {}).get("tp", 1))
    if tp > 1 or (doc.get("resharded") or {}).get("dir"):
        why = f"holds {tp} tensor-parallel shards" if tp > 1 else "is in DeepSpeed's universal format (resharded)"
        raise CheckpointError(f"checkpoint {tag} {why}; make a whole-model copy first: loongforge ckpt reshard "
                              f"{run_dir} --tag {tag} --to world=1,zero=0,tp=1")
    with ckpt_files.weights_only_loads():
        if zero_stage == 0:
            path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
            if not os.path.exists(path):
                raise CheckpointError(f"{path} missing: checkpoint {tag} is incomplete")
            state = torch.load(path, map_location="cpu", weights_only=True)["module"]
        else:
            # deepspeed is heavy: only ZeRO-1/2/3 checkpoints need its consolidation
            from deepspeed.utils.zero_to_fp32 import (
                get_fp32_state_dict_from_zero_checkpoint,
            )

            # zero_to_fp32 prints its progress (Processing, Parsing, Reconstructed ..., a tqdm bar) on stdout and
            # stderr: nothing a user of eval or export acts on. Kept for --verbose.
            said = io.StringIO()
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                state = get_fp32_state_dict_from_zero_checkpoint(ckpt_files.ckpt_root(run_dir), tag=tag)
            log.debug("zero_to_fp32 of %s:\n%s", tag, said.getvalue().strip())
    return {k: v.float() for k, v in state.items()}
