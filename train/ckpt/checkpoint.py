"""Checkpoint and resume, the trainer's side: `Checkpointer` saves DeepSpeed's own state dicts
asynchronously (async_writer.py) with a versioned JSON sidecar (loader state, step, world size,
ZeRO stage), per-rank torch RNG state and a sha256 manifest; `load` resumes one, after checking
that it fits this run's layout (`check_layout`, `check_resume_layout`) and restoring delta saves
(delta.py). The directory layout and the trust rules: files.py.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import delta as ckpt_delta, reshard_frozen, universal as ckpt_universal
from loongforge.train.ckpt.reshard import split_tp, tp_kinds
from loongforge.train.ckpt.async_writer import DeltaPolicy, SaveJob, SnapshotEngine, Writer, prune_before_write
from loongforge.train.ckpt.files import (CHECKPOINT_VERSION, SIDECAR, ckpt_root, read_pointer, read_sidecar, tag_for,
                                         verify_manifest, weights_only_loads)
from loongforge.train.ckpt.reshard_io import load_tag_dir
from loongforge.train.parallel.plan import ParallelState, is_hybrid, layout

log = logging.getLogger(__name__)


class Checkpointer:
    """The save side: snapshot in the step loop, write in the background (or inline with
    background=False), at most one save in flight."""

    def __init__(self, engine, run_dir: str, *, rank: int, world: int, device: torch.device,
                 background: bool = True, when_busy: str = "wait", keep_last: int = 0, write_mbps: float = 0.0,
                 peer_timeout_s: float = 600.0, full_every: int = 0, delta_max_ratio: float = 0.5):
        self.engine, self.root, self.rank, self.world, self.device = engine, ckpt_root(run_dir), rank, world, device
        self.background, self.when_busy, self.keep_last = background, when_busy, keep_last
        self.write_mbps, self.peer_timeout_s = write_mbps, peer_timeout_s
        self.snap = SnapshotEngine(engine.checkpoint_engine)
        engine.checkpoint_engine = self.snap
        # DeepSpeed copies zero_to_fp32.py into the checkpoint root on every save, in the step loop; on a full
        # disk that raises between its barriers. The writer copies it once instead (async_writer.py).
        engine._copy_recovery_script = lambda save_path: None
        self.writer = Writer()
        self.skipped = 0
        # Deltas (delta.py): full every `full_every` saves (0/1: always full). The base states stay in host
        # memory (one extra copy of this rank's checkpoint), so a delta never rereads the disk.
        self.full_every, self.delta_max_ratio = full_every, delta_max_ratio
        self._bases: dict = {}
        self._delta: DeltaPolicy | None = None
        self._since_full = 0

    def save(self, *, step: int, loader_state: dict, extra: dict, final: bool = False,
             blobs: tuple = ()) -> str | None:
        """Snapshot now, write later. Returns the tag, or None when skipped because the previous
        save is still being written (when_busy="skip"; never for the final save)."""
        if self.when_busy == "skip" and not final and self._any_rank_busy():
            self.skipped += 1
            log.info("checkpoint at step %d skipped: the previous one is still being written", step)
            return None
        self.writer.wait()  # when_busy="wait": block here, not in the middle of DeepSpeed's collectives
        tag = tag_for(step)
        tag_dir = os.path.join(self.root, tag)
        if self.rank == 0 and os.path.isdir(tag_dir) and tag != read_pointer(self.root):
            # Debris of an earlier attempt at this step (a killed save, a run resumed before it): its stale
            # per-rank manifests must not be merged into this one. DeepSpeed's first barrier in
            # save_checkpoint orders this before any rank's writer starts.
            shutil.rmtree(tag_dir, ignore_errors=True)
        if self.rank == 0 and os.path.isdir(self.root):
            prune_before_write(self.root, keep_last=self.keep_last)
        # save_latest=False: DeepSpeed's own pointer would be written before our sidecar and manifest exist.
        self.engine.save_checkpoint(self.root, tag=tag, client_state={"loongforge_step": step}, save_latest=False)
        # `blobs`: this rank's extra (file name, bytes) for the tag directory (e.g. compression residuals).
        blobs = [(os.path.join(tag_dir, f"rng_rank{self.rank}.pt"), _rng_bytes()),
                 *((os.path.join(tag_dir, name), data) for name, data in blobs)]
        if self.rank == 0:
            doc = {"format": "loongforge-checkpoint", "format_version": CHECKPOINT_VERSION, "step": step,
                   "world": self.world, "loader": loader_state, **extra}
            blobs.append((os.path.join(tag_dir, SIDECAR), json.dumps(doc, indent=2, sort_keys=True).encode()))
        job = SaveJob(root=self.root, tag=tag, rank=self.rank, world=self.world, snapshots=self.snap.take(),
                      blobs=blobs, keep_last=self.keep_last, write_mbps=self.write_mbps,
                      peer_timeout_s=self.peer_timeout_s, delta=self._next_delta(final), final=final)
        self.writer.submit(job, background=self.background and not final)
        return tag

    def _next_delta(self, final: bool) -> DeltaPolicy | None:
        if self.full_every <= 1:
            return None
        prev = self._delta  # its writer has finished: save() waited for it
        if prev is not None:
            self._since_full = 0 if (prev.wrote_full and self.writer.last_ok) else self._since_full + 1
        self._delta = DeltaPolicy(bases=self._bases, max_ratio=self.delta_max_ratio,
                                  # The last save of a run is full: Policy.load and zero_to_fp32 read it as is.
                                  want_full=final or self._since_full + 1 >= self.full_every)
        return self._delta

    def _any_rank_busy(self) -> bool:
        """Skip must be unanimous: a rank that saves while a peer skips would wait in DeepSpeed's barrier."""
        busy = torch.tensor([1.0 if self.writer.busy() else 0.0], device=self.device)
        if torch.distributed.is_initialized() and self.world > 1:
            torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
        return bool(busy.item())

    def close(self, timeout_s: float | None = None, *, peers_gone: bool = False) -> bool:
        """Wait for the save in flight; False if it was still running after timeout_s. `peers_gone`: the
        rank ends because a peer is gone, whose part of that save may never come (Writer.peers_gone)."""
        if peers_gone:
            self.writer.peers_gone()
        done = self.writer.wait(timeout_s)
        if not done:
            log.warning("checkpoint writer still busy after %.0fs at exit; `latest` stays on the previous "
                        "checkpoint", timeout_s or 0)
        return done


def _rng_bytes() -> bytes:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    buf = io.BytesIO()
    torch.save(rng, buf)
    return buf.getvalue()


def check_layout(doc: dict, run_dir: str, tag: str, *, world: int, zero_stage: int) -> str:
    """How to load a checkpoint on this layout: "same" (rank count and ZeRO stage unchanged: everything
    restored), "replicated" (ZeRO-0 on both sides, fp32: the optimizer state is whole in every copy, only the
    per-rank RNG is not restored), "module" (ZeRO-0/1/2 otherwise: weights kept, partitioned optimizer state
    re-initialized; the elastic supervisor converts first, resilience/elastic/reshard.py)
    or "universal" (ZeRO-3 on both sides, another rank count: converted with ds_to_universal, weights and Adam
    state kept). A change between ZeRO-3 and ZeRO-0/1/2 is refused here, before DeepSpeed fails deep inside
    with a bare AssertionError; the message names the `loongforge ckpt reshard` command that converts it.
    The saved stage comes from the sidecar, never from the current --zero."""
    saved_world, saved_stage = doc["world"], doc.get("zero_stage")
    if saved_world == world and saved_stage in (None, zero_stage):
        return "same"
    if saved_stage is None:
        raise CheckpointError(f"checkpoint sidecar records no ZeRO stage; resume it on {saved_world} ranks with "
                              "the --zero it was written with")
    if saved_stage == 3 and zero_stage == 3:
        return "universal"
    if saved_stage == 0 and zero_stage == 0 and not _partitioned_files(run_dir, tag):
        return "replicated"  # a plain torch optimizer, whole in mp_rank_XX: loads on any DP degree
    if 3 in (saved_stage, zero_stage):
        # DeepSpeed's universal loader expects the source's model-states layout: a ZeRO-3 checkpoint
        # (per-rank parameter shards) does not load into ZeRO-0/1/2, nor the reverse. `loongforge ckpt reshard`
        # converts it offline (NOTE: pointed at, not auto-run: it writes a new tag and moves `latest`, an
        # operator's decision that should not happen inside a launch whose peers wait in a timed collective).
        raise CheckpointError(
            f"checkpoint {tag} was written by {saved_world} ranks with ZeRO-{saved_stage}; it cannot be resumed "
            f"with ZeRO-{zero_stage} as it is (parameters are partitioned on one side only). Convert it first "
            f"(fp32 weights, Adam moments, step and data position are kept): "
            f"{reshard_command(run_dir, doc, world=world, zero_stage=zero_stage)} ; or resume with --zero "
            f"{saved_stage} on any rank count")
    return "module"


def check_resume_layout(sidecar: dict, state: ParallelState, tag: str, world: int | None = None, *,
                        run_dir: str = "RUN", zero_stage: int | None = None) -> None:
    """The tensor/sequence-parallel side of check_layout: model and ZeRO files are cut per TP rank
    (mp_rank_XX), so a different layout cannot load them as they are; `loongforge ckpt reshard`
    converts them (reshard.py), and the message names its command."""
    saved = {"tp": 1, "sp": 1, **sidecar.get("parallel", {})}
    w = world if world is not None else sidecar.get("world", 1)
    z = zero_stage if zero_stage is not None else sidecar.get("zero_stage", 2)
    fix = f"loongforge ckpt reshard {run_dir} --to world={w},zero={max(int(z), 1)},tp={state.plan.tp}" + \
        (f",sp={state.plan.sp}" if state.plan.sp > 1 else "")
    if is_hybrid(state) and world is not None and sidecar.get("world", world) != world:
        raise CheckpointError(f"checkpoint {tag} was written by {sidecar['world']} ranks, this run has {world}: "
                              "with --tp/--sp/--grad-compression a resume on another rank count needs the "
                              f"checkpoint converted first: {fix}")
    if saved != layout(state):
        raise CheckpointError(f"checkpoint {tag} was written with tp={saved['tp']} sp={saved['sp']}, this run has "
                              f"tp={state.plan.tp} sp={state.plan.sp}: its tensor-parallel shards do not fit; "
                              f"convert it first: {fix} (or resume with the same --tp/--sp)")


def _partitioned_files(run_dir: str, tag: str) -> bool:
    """ZeRO-0 with bf16 runs DeepSpeed's BF16_Optimizer, which partitions its fp32 master weights by DP
    rank (zero_pp_rank_* files) like ZeRO-1."""
    try:
        return any(n.startswith("zero_pp_rank_") for n in os.listdir(os.path.join(ckpt_root(run_dir), tag)))
    except OSError:
        return False


def reshard_command(run_dir: str, doc: dict, *, world: int, zero_stage: int, tp: int | None = None) -> str:
    tp = tp if tp is not None else int(doc.get("parallel", {}).get("tp", 1))
    return f"loongforge ckpt reshard {run_dir} --to world={world},zero={zero_stage},tp={tp}"


def load(engine, run_dir: str, tag: str, *, rank: int, world: int, zero_stage: int, device=None) -> dict:
    doc = read_sidecar(run_dir, tag)
    bases = verify_manifest(run_dir, tag).get("bases", []) if doc["format_version"] >= 2 else []
    load_tag = tag
    if bases:
        load_tag = ckpt_delta.restore_deltas(run_dir, tag, bases, rank=rank, device=device or torch.device("cpu"))
    rdir = load_tag_dir(doc, load_tag, rank)
    if rdir is not None:  # written by `loongforge ckpt reshard`: per-TP-rank universal folders
        return _load_resharded(engine, run_dir, tag, doc, rdir, rank=rank, world=world, zero_stage=zero_stage)
    how = check_layout(doc, run_dir, tag, world=world, zero_stage=zero_stage)
    if how == "universal":
        src = os.path.join(ckpt_root(run_dir), load_tag)
        udir = ckpt_universal.ensure_universal(src, rank=rank, device=device or torch.device("cpu"))
        path, _ = ckpt_universal.load_universal(engine, ckpt_root(run_dir), os.path.basename(udir))
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the universal checkpoint {udir}")
        log.info("resumed %s (%d ranks, ZeRO-%s) on %d ranks with ZeRO-%d through a universal checkpoint: "
                 "weights and Adam state kept", tag, doc["world"], doc["zero_stage"], world, zero_stage)
        return doc
    if how == "module":
        log.warning("resuming %s on %d ranks with ZeRO-%d (saved on %d ranks, ZeRO-%s): model weights and data "
                    "order are kept, the partitioned ZeRO optimizer state is re-initialized (to keep it, convert "
                    "the checkpoint first: %s)", tag, world, zero_stage, doc["world"], doc["zero_stage"],
                    reshard_command(run_dir, doc, world=world, zero_stage=zero_stage))
    same_world = how == "same"
    whole = how in ("same", "replicated")  # optimizer + LR schedule load as they are
    try:
        with weights_only_loads():
            path, _ = engine.load_checkpoint(ckpt_root(run_dir), tag=load_tag, load_optimizer_states=whole,
                                             load_lr_scheduler_states=whole, load_module_only=not whole)
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


def _load_resharded(engine, run_dir: str, tag: str, doc: dict, rdir: str, *, rank: int, world: int,
                    zero_stage: int) -> dict:
    """A resharded tag holds, per target TP rank, a universal folder that DeepSpeed cuts into any DP
    degree and ZeRO stage 1-3 itself; the TP degree was checked before (check_resume_layout)."""
    if zero_stage == 0:
        fix = reshard_command(run_dir, doc, world=world, zero_stage=0)
        raise CheckpointError(f"checkpoint {tag} was resharded for ZeRO-{doc['zero_stage']}; DeepSpeed's universal "
                              f"loader fills ZeRO-1/2/3 optimizers only: resume with --zero {doc['zero_stage']}, or "
                              f"reshard it again with zero=0: {fix}")
    path, _ = ckpt_universal.load_universal(engine, ckpt_root(run_dir), rdir)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the resharded checkpoint {rdir} under {ckpt_root(run_dir)}")
    kinds, tp = tp_kinds(doc), int(doc.get("parallel", {}).get("tp", 1))
    frozen = reshard_frozen.restore(engine, os.path.join(ckpt_root(run_dir), tag, reshard_frozen.FROZEN_FILE),
                                    lambda full, name: split_tp(full, kinds.get(name), rank % tp, tp))
    src = doc["resharded"]["from"]
    log.info("resumed %s (resharded from %s: %d ranks, ZeRO-%d, tp=%d) on %d ranks with ZeRO-%d: fp32 weights, "
             "Adam moments and step kept, %d frozen parameters restored", tag, doc["resharded"]["from_tag"],
             src["world"], src["zero_stage"], src["tp"], world, zero_stage, frozen)
    return doc
