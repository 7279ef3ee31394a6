"""Asynchronous checkpoint writes: snapshot to host memory in the step loop,
write + fsync + hash + publish in a background thread.

Design (see train/README.md, "Checkpoints"):
* DeepSpeed still decides WHAT is saved: `engine.save_checkpoint` builds every
  file's state dict (rank 0's model states, each rank's own ZeRO partition,
  under ZeRO-3 each rank's parameter shard) and hands each one to its
  checkpoint engine. `SnapshotEngine` is that checkpoint engine: instead of
  torch.save it copies the tensors into reusable host buffers (pinned on CUDA,
  one sync per save) and returns. So the on-disk layout stays DeepSpeed's and
  `load_checkpoint` / `ds_to_universal` read it unchanged.
* `Writer` (one thread per rank) serializes each snapshot to `NAME.tmp`,
  hashing (sha256) as it writes, fsyncs, renames, then writes
  `manifest.rankR.json`. Rank 0 waits for every rank's manifest (files on the
  shared checkpoint filesystem, no collective: the main thread owns the
  process group), merges them into `manifest.json`, and moves `latest` last.
* Any error while writing (ENOSPC, EIO, a peer that failed) removes this
  save's files, logs one WARNING naming the path and the free space, and leaves
  `latest` on the previous checkpoint; training is never interrupted by it.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.ckpt import delta as ckpt_delta
from loongforge.train.ckpt.files import MANIFEST, MANIFEST_VERSION, read_pointer

log = logging.getLogger(__name__)
_PEER_POLL_S = 0.05


class SnapshotEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine that snapshots to host memory instead of writing.

    Host buffers are kept between saves and reused when shapes match (at most one
    save is in flight, so the previous snapshot is written before they are reused)."""

    def __init__(self, inner: CheckpointEngine):
        super().__init__()
        self.name = "LoongForgeSnapshot"
        self.inner = inner  # DeepSpeed's own engine: loads go through it unchanged
        self.pending: list[tuple[str, object]] = []
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    def create(self, info) -> None:
        self.pending = []

    def makedirs(self, path, exist_ok=False) -> None:
        pass  # the writer creates directories, so a full disk fails in one place, off the step loop

    def save(self, state_dict, path: str) -> None:
        key = os.path.basename(path)
        self.pending.append((path, self._to_host(state_dict, (key,))))

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # _to_host already makes compact copies; DeepSpeed's clone would copy twice

    def take(self) -> list[tuple[str, object]]:
        """The snapshots of the save that just ran, complete in host memory."""
        if self._pin and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the non_blocking D2H copies have landed
        out, self.pending = self.pending, []
        return out

    def _to_host(self, item, key: tuple):
        if torch.is_tensor(item):
            return self._copy(item, key)
        if isinstance(item, dict):
            return type(item)((k, self._to_host(v, key + (k,))) for k, v in item.items())
        if isinstance(item, (list, tuple)):
            return type(item)(self._to_host(v, key + (i,)) for i, v in enumerate(item))
        return copy.deepcopy(item)  # loss scalers, configs: later steps must not change the snapshot

    def _copy(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin and t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


@dataclass
class SaveJob:
    root: str
    tag: str
    rank: int
    world: int
    snapshots: list[tuple[str, object]]  # absolute path -> object for torch.save
    blobs: list[tuple[str, bytes]] = field(default_factory=list)  # absolute path -> bytes (sidecar, RNG)
    keep_last: int = 0
    write_mbps: float = 0.0
    peer_timeout_s: float = 600.0
    delta: DeltaPolicy | None = None  # None: every file full
    final: bool = False  # the run's last save (or the one on SIGTERM): no later save retries it
    peers_gone: threading.Event = field(default_factory=threading.Event)  # no missing manifest will come


@dataclass
class DeltaPolicy:
    """Encode this save as deltas against `bases` (file name -> (tag, state) of the last full save);
    fall back to full when the deltas would exceed max_ratio x the full size. The writer updates
    `bases` after a full save, and sets `wrote_full`."""
    bases: dict
    max_ratio: float = 0.5
    want_full: bool = False
    wrote_full: bool | None = None
    ratio: float | None = None


class _HashingFile:
    """File sink for torch.save: hashes, counts, throttles and remembers the real OSError
    (torch wraps it in an opaque 'unexpected pos' RuntimeError)."""

    def __init__(self, path: str, mbps: float):
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.n, self.error, self.mbps, self.t0 = 0, None, mbps, time.monotonic()

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as exc:
            self.error = exc
            raise
        self.sha.update(b)
        self.n += n
        if self.mbps > 0:  # spread the write so the loader's reads of the same disk are not starved
            ahead = self.n / (self.mbps * 1e6) - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)
        return n

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.n, "sha256": self.sha.hexdigest()}


def _write_one(path: str, obj, mbps: float) -> dict:
    tmp = path + ".tmp"
    sink = _HashingFile(tmp, mbps)
    try:
        if isinstance(obj, (bytes, bytearray)):
            sink.write(obj)
        else:
            torch.save(obj, sink)
        entry = sink.finish()
    except BaseException as exc:
        sink.f.close()
        if sink.error is not None and sink.error is not exc:
            raise sink.error from exc
        raise
    os.replace(tmp, path)
    return entry


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def run_job(job: SaveJob) -> bool:
    """Write one rank's part of a checkpoint; rank 0 also publishes it. True when this rank's part
    (and for rank 0 the whole checkpoint) is on disk; False after a logged failure."""
    tag_dir = os.path.join(job.root, job.tag)
    current = "<start>"
    try:
        os.makedirs(tag_dir, exist_ok=True)
        snapshots = _encode_deltas(job) if job.delta else job.snapshots
        as_delta = job.delta is not None and not job.delta.wrote_full
        bases = sorted({t for t, _ in job.delta.bases.values()}) if as_delta else []
        files = {}
        # DeepSpeed's files sit directly in tag_dir; no makedirs per file, so writing into a directory that
        # rank 0 removed after a failure fails here instead of recreating it.
        for path, obj in [*snapshots, *job.blobs]:
            current = path
            files[os.path.relpath(path, tag_dir)] = _write_one(path, obj, job.write_mbps)
        current = os.path.join(tag_dir, f"manifest.rank{job.rank}.json")
        write_bytes_atomic(current, json.dumps({"files": files, "bases": bases}, sort_keys=True).encode())
        if job.delta is not None and not as_delta:  # the next deltas are taken against this save
            job.delta.bases.clear()
            job.delta.bases.update({os.path.basename(p): (job.tag, ckpt_delta.clone_tree(o))
                                    for p, o in job.snapshots})
        if job.rank == 0:
            current = os.path.join(tag_dir, MANIFEST)
            _publish(job, tag_dir)
        return True
    except Exception as exc:  # noqa: BLE001 - any I/O failure: keep training, keep the previous `latest`
        _abandon(job, tag_dir, current, exc)
        return False


def _publish(job: SaveJob, tag_dir: str) -> None:
    files, bases = _gather_rank_manifests(job, tag_dir)
    doc = {"format": "loongforge-checkpoint-manifest", "format_version": MANIFEST_VERSION, "tag": job.tag,
           "world": job.world, "files": files, "bases": bases}
    write_bytes_atomic(os.path.join(tag_dir, MANIFEST), json.dumps(doc, indent=1, sort_keys=True).encode())
    _fsync_dir(tag_dir)
    write_bytes_atomic(os.path.join(job.root, "latest"), job.tag.encode())  # LAST: the commit point
    _fsync_dir(job.root)
    _copy_recovery_scripts(job.root)
    prune(job.root, keep_last=job.keep_last)


def _gather_rank_manifests(job: SaveJob, tag_dir: str) -> tuple[dict, list[str]]:
    deadline = time.monotonic() + job.peer_timeout_s
    files: dict = {}
    bases: set = set()
    for r in range(job.world):
        part = os.path.join(tag_dir, f"manifest.rank{r}.json")
        failed = os.path.join(tag_dir, f"failed.rank{r}")
        while not os.path.exists(part):
            if os.path.exists(failed):
                raise OSError(f"rank {r} could not write its part: {open(failed).read().strip()}")
            if job.peers_gone.is_set():  # the rank ends because a peer is gone: its part never comes
                raise OSError(f"rank {r} wrote no manifest and a peer of this rank is gone")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} wrote no manifest within {job.peer_timeout_s:.0f}s")
            time.sleep(_PEER_POLL_S)
        with open(part) as f:
            doc = json.load(f)
        files.update(doc["files"])
        bases.update(doc["bases"])
    return files, sorted(bases)


def _encode_deltas(job: SaveJob) -> list[tuple[str, object]]:
    """This rank's files as NAME.delta against the base, or unchanged (full) when a base is missing, a full
    save is due, or the deltas would be larger than max_ratio x full."""
    d = job.delta
    d.wrote_full = True
    if d.want_full or any(os.path.basename(p) not in d.bases for p, _ in job.snapshots):
        return job.snapshots
    if any(not os.path.exists(os.path.join(job.root, t, MANIFEST)) for t, _ in d.bases.values()):
        return job.snapshots  # the base was never published (its save failed on another rank)
    out, payload, full = [], 0, 0
    for path, obj in job.snapshots:
        base_tag, base = d.bases[os.path.basename(path)]
        tree, n = ckpt_delta.encode(obj, base)
        payload, full = payload + n, full + ckpt_delta.nbytes(obj)
        out.append((path + ckpt_delta.SUFFIX, ckpt_delta.wrap(tree, base_tag)))
    d.ratio = payload / max(full, 1)
    if d.ratio > d.max_ratio:
        log.info("checkpoint %s: delta would be %.0f%% of a full save (> %.0f%%): writing it full", job.tag,
                 100 * d.ratio, 100 * d.max_ratio)
        return job.snapshots
    d.wrote_full = False
    log.info("checkpoint %s: delta against %s, %.1f%% of a full save", job.tag,
             ",".join(sorted({t for t, _ in d.bases.values()})), 100 * d.ratio)
    return out


def _abandon(job: SaveJob, tag_dir: str, path: str, exc: Exception) -> None:
    for tmp in glob.glob(os.path.join(tag_dir, "**", "*.tmp"), recursive=True):
        _unlink(tmp)
    for p, _ in [*job.snapshots, *job.blobs]:
        _unlink(p)  # this rank's finished files too: the checkpoint is incomplete without them
        _unlink(p + ckpt_delta.SUFFIX)
    if job.rank == 0:
        shutil.rmtree(tag_dir, ignore_errors=True)  # peers see the directory gone and fail their part
    else:
        try:  # tell rank 0 now instead of after its timeout (tiny; fits once our files are gone)
            write_bytes_atomic(os.path.join(tag_dir, f"failed.rank{job.rank}"), repr(exc)[:500].encode())
        except OSError:
            pass
    free = free_bytes(path)
    free_s = "unknown" if free is None else f"{free} bytes ({free / 2**20:.2f} MiB)"
    prev = read_pointer(job.root)
    then = "and no later save retries it (the run's last)" if job.final else \
        "training continues and the next save retries"
    log.warning("checkpoint %s NOT saved (rank %d): %s: %s while writing %s (%s free there); "
                "partial files removed, `latest` stays %s, %s",
                job.tag, job.rank, type(exc).__name__, exc, path, free_s, prev or "<none>", then)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_recovery_scripts(root: str) -> None:
    """DeepSpeed's zero_to_fp32.py beside the checkpoints (its engine would copy it in the step loop)."""
    src_dir = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        dst = os.path.join(root, name)
        if not os.path.exists(dst) and os.path.exists(os.path.join(src_dir, name)):
            try:
                shutil.copyfile(os.path.join(src_dir, name), dst)
            except OSError as exc:
                log.warning("could not copy %s next to the checkpoints: %s", name, exc)
                _unlink(dst)


def prune(root: str, *, keep_last: int) -> list[str]:
    """Remove the debris of crashed saves (unpublished tags older than `latest`) and, with
    keep_last > 0, published checkpoints beyond the newest keep_last, except the full saves that a kept
    delta save is based on (a chain goes only once a newer full one is published). Never removes `latest`."""
    latest = read_pointer(root)
    if latest is None:
        return []
    tags = sorted(d for d in os.listdir(root) if d.startswith("step") and os.path.isdir(os.path.join(root, d)))
    published = [t for t in tags if t <= latest and os.path.exists(os.path.join(root, t, MANIFEST))]
    doomed = [t for t in tags if t < latest and t not in published]
    if keep_last > 0:
        # One published checkpoint before `latest` always stays: the fallback when `latest` fails its sha256
        # check on resume (fallback.py). keep_last=1 drops it just before the next write (prune_before_write).
        kept = set(published[-max(keep_last, 2):]) | {latest}
        for t in list(kept):
            kept.update(_manifest_bases(os.path.join(root, t)))
        doomed += [t for t in published if t not in kept]
    for t in doomed:
        shutil.rmtree(os.path.join(root, t), ignore_errors=True)
    return doomed


def prune_before_write(root: str, *, keep_last: int) -> list[str]:
    """keep_last=1 (a disk with room for two checkpoints): drop the fallback before writing the next one, so
    the disk holds `latest` + the save in flight, and `latest` + its fallback once that is published."""
    if keep_last != 1:
        return []
    latest = read_pointer(root)
    bases = set(_manifest_bases(os.path.join(root, latest))) if latest else set()
    doomed = [t for t in os.listdir(root) if t.startswith("step") and t[4:].isdigit() and latest
              and t < latest and t not in bases and os.path.exists(os.path.join(root, t, MANIFEST))]
    for t in doomed:
        shutil.rmtree(os.path.join(root, t), ignore_errors=True)
    return doomed


def _manifest_bases(tag_dir: str) -> list[str]:
    try:
        with open(os.path.join(tag_dir, MANIFEST)) as f:
            return json.load(f).get("bases", [])
    except (OSError, ValueError):
        return []


class Writer:
    """One background thread per rank; at most one save in flight."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None
        self.last_ok: bool | None = None
        self.last_s: float | None = None  # how long the last completed save took to write (SIGTERM: will it fit?)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: SaveJob, *, background: bool) -> None:
        self.wait()
        if not background:
            self._run(job)
            return
        self._job = job
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"ckpt-writer-{job.tag}", daemon=True)
        self._thread.start()

    def peers_gone(self) -> None:
        """A peer rank is gone (this rank ends after a failed collective): the save in flight stops waiting
        for the parts of ranks that have not written theirs, which would never come (up to peer_timeout_s,
        while the job waits for this rank to exit before it restarts). Parts already written still publish."""
        if self._job is not None:
            self._job.peers_gone.set()

    def _run(self, job: SaveJob) -> None:
        t0 = time.monotonic()
        self.last_ok = run_job(job)
        if self.last_ok:
            self.last_s = time.monotonic() - t0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight save is written; False if it is still running after timeout."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True
