"""A run's checkpoint directory on disk: paths, the `latest` pointer, the sidecar, the manifest
check and trusted loads. Every other checkpoint module builds on these; they import nothing of
the trainer.

Layout under RUN_DIR/checkpoints/:
    step00000005/                 DeepSpeed tag directory (model + ZeRO states, DeepSpeed's names)
    step00000005/loongforge.json  sidecar, format_version CHECKPOINT_VERSION
    step00000005/rng_rank0.pt     torch RNG state (loaded with weights_only=True)
    step00000005/manifest.json    bytes + sha256 of every file; written after all ranks' files
    latest                        tag name; written LAST, atomically, by rank 0
A crash mid-save (or a full disk) leaves `latest` on the previous complete
checkpoint; a load verifies every file against the manifest first.

Trust: every load is weights_only. DeepSpeed's load_checkpoint (0.19) calls
torch.load(weights_only=False) itself, so loads run under `weights_only_loads`:
TORCH_FORCE_WEIGHTS_ONLY_LOAD with only the few DeepSpeed value types its
checkpoints hold allowlisted, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager

from loongforge.shared.errors import CheckpointError
from loongforge.shared.storage import HASH_CHUNK

CHECKPOINT_VERSION = 2  # 2: manifest.json with sha256 per file
READABLE_VERSIONS = (1, 2)
SIDECAR = "loongforge.json"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def read_pointer(root: str) -> str | None:
    """The tag `latest` names under a checkpoint root, unchecked (None: none, or unreadable)."""
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def latest_tag(run_dir: str) -> str | None:
    path = os.path.join(ckpt_root(run_dir), "latest")
    if not os.path.exists(path):
        return None
    tag = open(path).read().strip()
    if not tag or not os.path.isdir(os.path.join(ckpt_root(run_dir), tag)):
        raise CheckpointError(f"{path} names {tag!r}, which is not a checkpoint directory: the run dir was "
                              "edited or partially copied; point `latest` at a complete stepNNNNNNNN directory")
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
    if doc.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format_version {doc.get('format_version')!r}, this build reads "
                              f"{CHECKPOINT_VERSION}; resume with the LoongForge version that wrote it")
    return doc


def verify_manifest(run_dir: str, tag: str) -> dict:
    """Every file the manifest lists exists with its size and sha256; raise CheckpointError naming the first
    that does not. Returns the manifest."""
    tag_dir = os.path.join(ckpt_root(run_dir), tag)
    path = os.path.join(tag_dir, MANIFEST)
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} unreadable ({exc}): checkpoint {tag} was not published completely; "
                              "point `latest` at an earlier tag") from exc
    if doc.get("format_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path}: manifest format_version {doc.get('format_version')!r}, this build reads "
                              f"{MANIFEST_VERSION}; resume with the LoongForge version that wrote it")
    for name, want in sorted(doc["files"].items()):
        fpath = os.path.join(tag_dir, name)
        sha, n = hashlib.sha256(), 0
        try:
            with open(fpath, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    sha.update(chunk)
                    n += len(chunk)
        except OSError as exc:
            raise CheckpointError(f"{fpath}: {exc}; checkpoint {tag} is damaged, resume from an earlier tag") from exc
        if n != want["bytes"] or sha.hexdigest() != want["sha256"]:
            raise CheckpointError(f"{fpath}: {n} bytes sha256 {sha.hexdigest()[:16]}.., manifest says "
                                  f"{want['bytes']} bytes {want['sha256'][:16]}..: checkpoint {tag} is corrupt; "
                                  "point `latest` at an earlier tag")
    return doc


def _deepspeed_value_types() -> list:
    """Plain-data classes DeepSpeed pickles into its optimizer states."""
    # deepspeed is heavy; only a load of its files gets here
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads():
    """Make every torch.load inside (DeepSpeed's included) weights_only=True."""
    import torch  # heavy: the paths, pointers and manifests here serve the torch-free elastic supervisor

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


def load_trusted(path: str):
    """torch.load of a checkpoint file: on the host, weights only, DeepSpeed's value types allowed."""
    import torch  # heavy, as in weights_only_loads

    with weights_only_loads():
        return torch.load(path, map_location="cpu", weights_only=True)
