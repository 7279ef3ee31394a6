"""Checkpoint and resume: DeepSpeed's own save/load plus a versioned JSON
sidecar (loader state, step, world size) and per-rank torch RNG state.

Layout under RUN_DIR/checkpoints/:
    step00000005/                 DeepSpeed tag directory (model + ZeRO states)
    step00000005/loongforge.json  sidecar, format_version CHECKPOINT_VERSION
    step00000005/rng_rank0.pt     torch RNG state (loaded with weights_only=True)
    latest                        tag name; written LAST, atomically, by rank 0
A crash mid-save leaves `latest` on the previous complete checkpoint.

Trust: every load is weights_only. DeepSpeed's load_checkpoint (0.19) calls
torch.load(weights_only=False) itself, so `load` runs it under
TORCH_FORCE_WEIGHTS_ONLY_LOAD with only the few DeepSpeed value types its
checkpoints hold allowlisted: a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.shared.storage import write_bytes_atomic

log = logging.getLogger(__name__)
CHECKPOINT_VERSION = 1
SIDECAR = "loongforge.json"


def _deepspeed_value_types() -> list:
    """Plain-data classes DeepSpeed pickles into its optimizer states."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads():
    """Make every torch.load inside (DeepSpeed's included) weights_only=True."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    old = os.environ.get(key)
    os.environ[key] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_value_types()):
            yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(run_dir: str) -> str | None:
    path = os.path.join(ckpt_root(run_dir), "latest")
    if not os.path.exists(path):
        return None
    tag = open(path).read().strip()
    if not tag or not os.path.isdir(os.path.join(ckpt_root(run_dir), tag)):
        raise CheckpointError(f"{path} names {tag!r}, which is not a checkpoint directory: the run dir was "
                              "edited or partially copied; point `latest` at a complete stepNNNNNNNN directory")
    return tag


def save(engine, run_dir: str, *, step: int, loader_state: dict, rank: int, world: int, extra: dict) -> str:
    tag = tag_for(step)
    root = ckpt_root(run_dir)
    # save_latest=False: DeepSpeed's own pointer would be written before our sidecar exists.
    engine.save_checkpoint(root, tag=tag, client_state={"loongforge_step": step}, save_latest=False)
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    tmp = os.path.join(tag_dir, f".rng_rank{rank}.pt.tmp")
    torch.save(rng, tmp)
    os.replace(tmp, os.path.join(tag_dir, f"rng_rank{rank}.pt"))
    if rank == 0:
        doc = {"format": "loongforge-checkpoint", "format_version": CHECKPOINT_VERSION, "step": step,
               "world": world, "loader": loader_state, **extra}
        write_bytes_atomic(os.path.join(tag_dir, SIDECAR), json.dumps(doc, indent=2, sort_keys=True).encode())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's shards and RNG are on disk before the pointer moves
    if rank == 0:
        write_bytes_atomic(os.path.join(root, "latest"), tag.encode())
    return tag


def read_sidecar(run_dir: str, tag: str) -> dict:
    path = os.path.join(ckpt_root(run_dir), tag, SIDECAR)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} missing: checkpoint {tag} is incomplete; resume from an earlier tag") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): corrupt checkpoint") from exc
    if doc.get("format_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: format_version {doc.get('format_version')!r}, this build reads "
                              f"{CHECKPOINT_VERSION}; resume with the LoongForge version that wrote it")
    return doc


def load(engine, run_dir: str, tag: str, *, rank: int, world: int, zero_stage: int) -> dict:
    doc = read_sidecar(run_dir, tag)
    same_world = doc["world"] == world
    if not same_world and zero_stage >= 3:
        raise CheckpointError(f"checkpoint {tag} was written by {doc['world']} ranks with ZeRO-3 (parameters are "
                              f"partitioned); resuming on {world} ranks needs a universal checkpoint "
                              "(deepspeed ds_to_universal.py) or the same rank count")
    if not same_world:
        log.warning("resuming %s on %d ranks (saved on %d): model weights and data order are kept, the "
                    "partitioned ZeRO optimizer state is re-initialized", tag, world, doc["world"])
    try:
        with weights_only_loads():
            path, _ = engine.load_checkpoint(ckpt_root(run_dir), tag=tag, load_optimizer_states=same_world,
                                             load_lr_scheduler_states=same_world, load_module_only=not same_world)
    except Exception as exc:  # pickle.UnpicklingError among them: name the checkpoint, keep the cause
        if "Weights only load failed" in str(exc):
            raise CheckpointError(f"checkpoint {tag} holds objects outside the weights-only allowlist; refusing "
                                  f"to unpickle them ({str(exc).splitlines()[-1][:300]})") from exc
        raise
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {ckpt_root(run_dir)}")
    rng_path = os.path.join(ckpt_root(run_dir), tag, f"rng_rank{rank}.pt")
    if same_world and os.path.exists(rng_path):
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return doc
