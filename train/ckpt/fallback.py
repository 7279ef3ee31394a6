"""Which checkpoint a resume loads: `latest` when every file it (and its delta
bases) lists matches the manifest's size and sha256, else the newest earlier
published checkpoint that does. Bad bytes are never handed to DeepSpeed.

The ranks agree on the checkpoint by NAME: rank 0 alone reads `latest` (one
reader of the shared checkpoint filesystem), resolves the fallback chain and
broadcasts the tag string; no other rank reads `latest`. A second launch
moving `latest`, or a shared filesystem caching the directory per node, can
therefore no longer give two ranks two checkpoints. After loading, every rank
checks that all ranks restored the same tag and step (`check_same_checkpoint`),
and refuses to train a mix. A failure on rank 0 reaches the peers with its
message instead of a hang.

Retention (async_writer.prune) keeps at least one published checkpoint before
`latest`, so there is something to fall back to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.files import MANIFEST, ckpt_root, verify_manifest
from loongforge.train.observe.metrics import METRICS_FILE, METRICS_VERSION

if TYPE_CHECKING:  # annotations only: the collectives below import it when they run
    import torch

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


def pick_resume_tag(run_dir: str, latest: str) -> str:
    """`latest` if it verifies, else the newest earlier published checkpoint that does (one WARNING per
    rejected tag, naming the file, and one ckpt_fallback record). Local, no collective: rank 0's part
    of `agree_resume_tag`, and the elastic supervisor's (no process group there)."""
    root = ckpt_root(run_dir)
    candidates, reasons = published_tags(root, latest), []
    if latest not in candidates:  # the manifest itself is missing: name it as the first reason
        candidates.insert(0, latest)
    for tag in candidates:
        try:
            verify_chain(run_dir, tag)
        except CheckpointError as exc:
            reasons.append(f"{tag}: {exc}")
            log.warning("checkpoint %s failed verification, not loading it: %s", tag, exc)
            continue
        if tag != latest:
            log.warning("resuming from %s instead of `latest` %s (it failed verification); the steps after %s "
                        "are redone", tag, latest, tag)
            _record_fallback(run_dir, latest, tag, reasons)
        return tag
    raise CheckpointError(f"no checkpoint in {root} verifies against its manifest ({'; '.join(reasons)}); start "
                          "without --resume or restore the files")


def agree_resume_tag(run_dir: str, *, rank: int, device: torch.device) -> str | None:
    """The checkpoint every rank resumes, or None for a fresh start. Collective when a process group is
    up: rank 0 reads `latest` once, picks (pick_resume_tag) and broadcasts the tag's name, or its error."""
    tag, err = "", ""
    if rank == 0:
        try:
            latest = ckpt_files.latest_tag(run_dir)
            tag = pick_resume_tag(run_dir, latest) if latest is not None else ""
        except CheckpointError as exc:
            err = str(exc)
    tag, err = _broadcast_text(tag, device), _broadcast_text(err, device)
    if err:
        raise CheckpointError(err + ("" if rank == 0 else " (rank 0's choice)"))
    return tag or None


def check_same_checkpoint(tag: str, step: int, *, device: torch.device) -> None:
    """Every rank restored the same tag and step, or CheckpointError on every rank naming what each
    loaded: a model mixing two checkpoints' partitions trains on, silently wrong, and its ranks drift
    steps apart until a save hangs."""
    import torch  # heavy: the supervisor picks and verifies tags here without it; only ranks gather

    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "big")
    mine = torch.tensor([step, digest], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, mine)
    got = [tuple(int(v) for v in t.cpu()) for t in out]
    if len(set(got)) > 1:
        steps = ", ".join(f"rank {r}: step {s}" for r, (s, _) in enumerate(got))
        raise CheckpointError(f"the ranks resumed different checkpoints ({steps}; this rank: {tag}): refusing to "
                              "train a mix of two checkpoints. Is another launch using this --run-dir? Stop it and "
                              "resume again")


def _record_fallback(run_dir: str, latest: str, loaded: str, reasons: list[str]) -> None:
    """One {"event": "ckpt_fallback"} line in metrics.jsonl (kept across resumes, like the watchdog's fault
    records): which `latest` was rejected and why (the file and its hash), and which checkpoint was loaded."""
    record = {"v": METRICS_VERSION, "event": "ckpt_fallback", "latest": latest, "loaded": loaded,
              "rejected": reasons, "t": time.time()}
    with contextlib.suppress(OSError), open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's string on every rank: its length, then its UTF-8 bytes (no pickle)."""
    import torch  # heavy, as in check_same_checkpoint

    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return text
    data = text.encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    torch.distributed.broadcast(n, src=0)
    if not n.item():
        return ""
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    if torch.distributed.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))
    torch.distributed.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


def raise_unless_rank0_ok(err: str, *, device: torch.device, failed: str, hint: str) -> None:
    """Every rank calls this after rank 0 did a step alone (err: its error, "" on success and on the
    other ranks). Collective: a failure on rank 0 raises CheckpointError on every rank, so no peer
    waits forever in the next collective; only rank 0 knows the reason."""
    import torch  # heavy, as in check_same_checkpoint

    ok = torch.tensor([0.0 if err else 1.0], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if ok.item() < 1:
        raise CheckpointError(f"{failed}{': ' + err if err else ' on rank 0'}; {hint}")
