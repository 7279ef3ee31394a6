"""Top-k gradient compression's error-feedback residuals (parallel/compression.py) across
`loongforge ckpt reshard`.

What a residual is: rank r keeps, per bucket of its local gradient partition (ZeRO-3 inside the
shard group, one (tp, sp) slot), the part of grad + residual that top-k did not send. The replicas
of one slot average what they send, so the gradient mass still pending for that slot is
    M = sum over its DP replicas d of residual_d / DP
and it reaches the weights over the next steps as each replica's residual is sent.

The rule (exact where exactness exists, mass-preserving where it does not):
* same DP degree, same TP x SP: every rank's residuals are copied as they are (bit-exact resume);
* another DP degree, same TP x SP: every new replica of a slot starts with M, so
  sum over the new replicas of M / DP' = M: no pending gradient mass is lost or doubled. The split
  between replicas is not recoverable (which entries top-k picks next depends on it), so the steps
  after such a resume are not bitwise those of the old layout; the gradient sum is;
* another TP or SP degree, or a target without ZeRO-3 (top-k runs under ZeRO-3 only): the local
  partitions are cut differently and the bucket layout changes; the residuals are dropped with a
  WARNING naming the pending mass (L2 norm of M), which error feedback then starts from zero
  (what a run without compression would have had anyway).

Rank placement (parallel/plan.py): rank = dp * (SP * TP) + sp * TP + tp, so the slot of a rank is
rank % (SP * TP) and its replica rank // (SP * TP).
"""

from __future__ import annotations

import logging
import os

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt.files import load_trusted

log = logging.getLogger(__name__)
PREFIX = "compressor_rank"


def has_residuals(tag_dir: str) -> bool:
    return any(n.startswith(PREFIX) for n in os.listdir(tag_dir))


def _name(rank: int) -> str:
    return f"{PREFIX}{rank}.pt"


def carry(src_dir: str, out_dir: str, src, to) -> str:
    """Write the target ranks' compressor files into out_dir by the rule above; returns what was done
    ("copied", "averaged" or "dropped") for the sidecar."""
    slots = src.tp * src.sp
    states = {}
    for r in range(src.world):
        path = os.path.join(src_dir, _name(r))
        if not os.path.exists(path):
            raise CheckpointError(f"{path} missing: the checkpoint holds residuals of some ranks only; resume it "
                                  "with the layout that wrote it")
        states[r] = load_trusted(path)
    means = {j: _mean([states[d * slots + j] for d in range(src.dp)]) for j in range(slots)}
    if (src.tp, src.sp) != (to.tp, to.sp) or to.zero != 3:
        norm = sum(float(t.double().square().sum()) for m in means.values() for t in m["residuals"]) ** 0.5
        log.warning("reshard: top-k error-feedback residuals dropped (tp x sp %dx%d -> %dx%d, ZeRO-%d -> ZeRO-%d: "
                    "the local gradient partitions are cut differently); pending gradient mass L2 %.4g is lost and "
                    "error feedback restarts from zero", src.tp, src.sp, to.tp, to.sp, src.zero, to.zero, norm)
        return "dropped"
    if src.dp == to.dp:
        for r, sd in states.items():
            torch.save(sd, os.path.join(out_dir, _name(r)))
        return "copied"
    for r in range(to.world):
        torch.save(means[r % slots], os.path.join(out_dir, _name(r)))
    log.info("reshard: top-k residuals of %d DP replicas averaged into each of %d (pending gradient mass kept)",
             src.dp, to.dp)
    return "averaged"


def _mean(sds: list[dict]) -> dict:
    """Bucket-wise mean of the replicas' residuals (float64 sum, cast back)."""
    versions = {sd.get("version") for sd in sds}
    shapes = {tuple(tuple(t.shape) for t in sd["residuals"]) for sd in sds}
    if len(versions) != 1 or len(shapes) != 1:
        raise CheckpointError(f"top-k residual files of one slot disagree (versions {versions}, bucket shapes "
                              f"{len(shapes)} kinds): not written by one run")
    out = [sum(sd["residuals"][i].double() for sd in sds).div(len(sds)).to(sds[0]["residuals"][i].dtype)
           for i in range(len(sds[0]["residuals"]))]
    return {**sds[0], "residuals": out}
