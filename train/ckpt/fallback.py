"""Which checkpoint a resume loads: `latest` when every file it (and its delta
bases) lists matches the manifest's size and sha256, else the newest earlier
published checkpoint that does. Bad bytes are never handed to DeepSpeed.

Rank 0 hashes the candidates (one reader of the shared checkpoint filesystem)
and broadcasts its choice, so every rank loads the same tag; a failure on rank 0
reaches the peers as "no usable checkpoint" instead of a hang.

Retention (async_writer.prune) keeps at least one published checkpoint before
`latest`, so there is something to fall back to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt.files import MANIFEST, ckpt_root, verify_manifest
from loongforge.train.observe.metrics import METRICS_FILE, METRICS_VERSION

log = logging.getLogger(__name__)


def published_tags(root: str, latest: str) -> list[str]:
    """Published checkpoints up to `latest` (they have manifest.json), newest first."""
    tags = [d for d in os.listdir(root) if d.startswith("step") and d[4:].isdigit() and d <= latest
            and os.path.exists(os.path.join(root, d, MANIFEST))]
    return sorted(tags, reverse=True)


def verify_chain(run_dir: str, tag: str) -> None:
    """The tag's manifest and, for a delta save, its bases' manifests; CheckpointError names the bad file."""
    doc = verify_manifest(run_dir, tag)
    for base in doc.get("bases", []):
        verify_manifest(run_dir, base)


def pick_resume_tag(run_dir: str, latest: str, *, rank: int, device: torch.device) -> str:
    """`latest` if it verifies, else the newest earlier published checkpoint that does (one WARNING per
    rejected tag, naming the file). Collective when a process group is up."""
    root = ckpt_root(run_dir)
    choice, reasons = -1, []
    candidates = published_tags(root, latest) if rank == 0 else []
    if rank == 0:
        if latest not in candidates:  # the manifest itself is missing: name it as the first reason
            candidates.insert(0, latest)
        for i, tag in enumerate(candidates):
            try:
                verify_chain(run_dir, tag)
            except CheckpointError as exc:
                reasons.append(f"{tag}: {exc}")
                log.warning("checkpoint %s failed verification, not loading it: %s", tag, exc)
                continue
            choice = i
            break
    picked = _broadcast_choice(choice, device)
    if picked < 0:
        raise CheckpointError(f"no checkpoint in {root} verifies against its manifest"
                              + (f" ({'; '.join(reasons)})" if reasons else " (see rank 0's log)")
                              + "; start without --resume or restore the files")
    if rank != 0:
        candidates = published_tags(root, latest)
        if latest not in candidates:
            candidates.insert(0, latest)
    tag = candidates[picked]
    if tag != latest:
        log.warning("resuming from %s instead of `latest` %s (it failed verification); the steps after %s are "
                    "redone", tag, latest, tag)
        if rank == 0:
            _record_fallback(run_dir, latest, tag, reasons)
    return tag


def _record_fallback(run_dir: str, latest: str, loaded: str, reasons: list[str]) -> None:
    """One {"event": "ckpt_fallback"} line in metrics.jsonl (kept across resumes, like the watchdog's fault
    records): which `latest` was rejected and why (the file and its hash), and which checkpoint was loaded."""
    record = {"v": METRICS_VERSION, "event": "ckpt_fallback", "latest": latest, "loaded": loaded,
              "rejected": reasons, "t": time.time()}
    with contextlib.suppress(OSError), open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _broadcast_choice(choice: int, device: torch.device) -> int:
    t = torch.tensor([choice], dtype=torch.int64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast(t, src=0)
    return int(t.item())


def raise_unless_rank0_ok(err: str, *, device: torch.device, failed: str, hint: str) -> None:
    """Every rank calls this after rank 0 did a step alone (err: its error, "" on success and on the
    other ranks). Collective: a failure on rank 0 raises CheckpointError on every rank, so no peer
    waits forever in the next collective; only rank 0 knows the reason."""
    ok = torch.tensor([0.0 if err else 1.0], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if ok.item() < 1:
        raise CheckpointError(f"{failed}{': ' + err if err else ' on rank 0'}; {hint}")
