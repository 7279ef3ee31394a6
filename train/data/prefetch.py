"""Async prefetch: batch N+1 is decoded, copied and colour-converted while
batch N computes.

One background thread owns the decode pool (submit, wait, release) and stages
each batch onto the device:
  CUDA: host slot -> pinned buffer (allocated once per buffer set, reused) ->
        non_blocking copy on a side stream -> NV12->RGB + normalization on that
        stream -> an event. The consumer makes its current stream wait on the
        event and calls `record_stream`, so the caching allocator never hands
        the memory to another stream early.
  CPU:  the same thread and hand-off, with no stream: convert (or copy) into a
        recycled output buffer, release. A buffer is reused only once nothing
        outside the pool references its memory (HostPool), so a caller that keeps
        a batch never sees it overwritten, and steady state allocates nothing
        (a fresh float batch per step costs its page faults: ~12 B per pixel).
        A pull() that filled the batch straight into such a buffer (inline decode:
        the loader passes its pool in as `host`) returns torch tensors, which are
        handed out as they are: NV12 out then copies nothing. With decode workers,
        NV12 out is lent straight out of the worker's shared-memory slot (SlotLender,
        the same storage-use-count check), also with no copy.
depth=0 runs everything synchronously in the caller (debugging, num_workers=0).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loongforge.shared.errors import DataWorkerError
from loongforge.train.data import colorspace_jit
from loongforge.train.data.colorspace import nv12_to_input, serial_cpu_ops_in_this_thread

_END = object()
JOIN_TIMEOUT_S = 30.0  # only reached if pull() cannot be interrupted; normally the join takes < 0.2 s
log = logging.getLogger(__name__)


@dataclass
class Staged:
    tensors: dict  # name -> tensor on device; "frames" -> {slot: tensor}
    meta: dict  # host-side: sample_ids (np), epoch, consumed, seq, bad
    event: object = None  # torch.cuda.Event on CUDA
    host_set: int = -1
    extra: dict = field(default_factory=dict)


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def resolve_device(device: str | torch.device) -> torch.device:
    """A device with an index: a bare "cuda" means the caller's current device.

    torch.cuda.set_device / Stream need an index, and the current device is per
    thread (the prefetch thread's default would be cuda:0, not the rank's GPU),
    so the index is fixed here, in the thread that made the loader."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Prefetcher:
    def __init__(self, pull: Callable[[], tuple[dict, dict[str, np.ndarray], Callable[[], None]]], *,
                 device: torch.device, matrix: str, color_range: str, mean: float, std: float,
                 rgb: bool = True, depth: int = 2, timeout_s: float = 300.0, host: HostPool | None = None):
        self.pull, self.device, self.depth, self.timeout_s = pull, resolve_device(device), depth, timeout_s
        self.conv = dict(matrix=matrix, color_range=color_range, mean=mean, std=std)
        self.rgb = rgb
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        # depth+2 pinned sets: `depth` queued, one being consumed, one being filled.
        self._pinned: list[dict[str, torch.Tensor]] = [{} for _ in range(depth + 2)] if self.cuda else []
        self._set_events = [None] * len(self._pinned)
        self._host = host if host is not None else HostPool.for_prefetch(depth)
        self._next_set = 0
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="loongforge-prefetch", daemon=True)
            self._thread.start()

    # -- producer side (background thread) -------------------------------------
    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread; default would be cuda:0
            elif self.rgb:
                serial_cpu_ops_in_this_thread()  # one pipeline stage: the workers and the model hold the other cores
                colorspace_jit.warm_up()  # compile (or load) the NV12 kernel now, while the workers decode
            while not self._stop.is_set():
                staged = self._stage_next()
                if staged is None:
                    self._put(_END)
                    return
                self._put(staged)
                # Not held while the next batch is staged: its buffers go back to the pool once the consumer
                # drops it (HostPool.for_prefetch counts no reference of this thread's).
                staged = None
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(exc))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _stage_next(self) -> Staged | None:
        try:
            meta, arrays, release = self.pull()
        except StopIteration:
            return None
        try:
            return self._stage_cuda(meta, arrays) if self.cuda else self._stage_cpu(meta, arrays)
        finally:
            release()  # the slot's bytes are copied out (pinned or cloned) before this returns

    def _convert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return nv12_to_input(t, **self.conv) if self.rgb and name.startswith("frames.") else t

    def _stage_cpu(self, meta, arrays) -> Staged:
        """numpy arrays view a ring slot and are copied out; torch tensors are already the
        consumer's memory (filled in place) and pass as they are, unless converted to RGB."""
        out = {}
        for name, arr in arrays.items():
            owned = isinstance(arr, torch.Tensor)
            t = arr if owned else torch.from_numpy(arr)
            if self.rgb and name.startswith("frames."):
                rows, w = t.shape[-2:]
                shape = (*t.shape[:-2], 3, rows * 2 // 3, w)
                out[name] = nv12_to_input(t, **self.conv, out=self._host.take(shape, torch.float32, name)).view(shape)
            elif owned:
                out[name] = t
            else:
                dst = self._host.take(t.shape, t.dtype, name)
                # NOTE: numpy, not Tensor.copy_: torch's copy is an OpenMP parallel region whose barrier waits
                # for pool threads the decode workers keep off the cores (several times slower on a busy machine).
                np.copyto(dst.numpy(), arr)
                out[name] = dst
        return Staged(_nest(out), meta)

    def _stage_cuda(self, meta, arrays) -> Staged:
        idx = self._next_set
        self._next_set = (idx + 1) % len(self._pinned)
        if self._set_events[idx] is not None:
            self._set_events[idx].synchronize()  # the last H2D copy out of this pinned set has finished
        pinned = self._pinned[idx]
        out = {}
        with torch.cuda.stream(self.stream):
            for name, arr in arrays.items():
                buf = pinned.get(name)
                if buf is None or buf.numel() < arr.size:
                    # First sight of this field at this size; buckets cap the sizes, so this stops after warm-up.
                    buf = pinned[name] = torch.empty(arr.size, dtype=_TORCH_DTYPES[arr.dtype.str],
                                                     pin_memory=True)
                host = buf[: arr.size].view(arr.shape)
                host.copy_(torch.from_numpy(arr))
                dev = host.to(self.device, non_blocking=True)
                out[name] = self._convert(name, dev)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._set_events[idx] = event
        return Staged(_nest(out), meta, event=event, host_set=idx)

    # -- consumer side -----------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Staged:
        if self._thread is None:
            staged = self._stage_next()
            if staged is None:
                raise StopIteration
            return self._ready(staged)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = self._q.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise DataWorkerError("prefetch thread ended without a batch or an error") from None
                if time.monotonic() > deadline:
                    raise DataWorkerError(f"no batch for {self.timeout_s:.0f} s from the prefetch thread") from None
        if item is _END:
            self._q.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        return self._ready(item)

    def _ready(self, staged: Staged) -> Staged:
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.event)
            for t in _flat(staged.tensors):
                t.record_stream(current)  # allocated on the side stream, used on the compute stream
        return staged

    def close(self) -> None:
        """Signal, unblock, join. The owner interrupts a pull() blocked in the pool first
        (ShardLoader does); a full queue is unblocked here, since _put polls _stop."""
        self._stop.set()
        if self._thread is not None:
            while True:  # a producer waiting on a full queue sees _stop within 0.1 s
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=JOIN_TIMEOUT_S)
            if self._thread.is_alive():  # a pull() that nothing can interrupt (inline decode of a huge batch)
                log.error("prefetch thread still running %.0f s after close(); abandoning it", JOIN_TIMEOUT_S)
            self._thread = None


class HostPool:
    """Recycled CPU tensors, handed out as fresh views of pooled buffers.

    A buffer is free again when no tensor outside the pool shares its storage: the consumer
    dropped the batch and autograd released what it saved. The check is the storage's use
    count (torch._C._storage_Use_Count; without it every take allocates, as before).
    `per_key` buffers at most per (name, shape, dtype), so a bound on the batches in flight is one
    on the buffers, whatever fields share a shape (two cameras, state and action): when all are
    held, a fresh buffer takes the place of the longest-held one, which stays with its consumer
    (kept batches leave the pool instead of filling it)."""

    def __init__(self, per_key: int):
        self.per_key = per_key  # 0: nothing is recycled, every take allocates (a benchmark's baseline)
        self._bufs: dict[tuple, list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made (pooled or not): a test and a benchmark read it

    @classmethod
    def for_prefetch(cls, depth: int, recycle: bool = True) -> "HostPool":
        """Sized for a Prefetcher of `depth`: `depth` batches queued, one with the consumer, one
        being staged, one staged and waiting for room in the queue."""
        return cls(per_key=depth + 3 if recycle else 0)

    def take(self, shape, dtype: torch.dtype, name: str = "") -> torch.Tensor:
        """A buffer for field `name` of a batch: one per name per batch."""
        shape = tuple(shape)
        bufs = self._bufs.setdefault((name, shape, dtype), [])  # in the order they were last handed out
        for i, buf in enumerate(bufs):
            if _unshared(buf):
                bufs.append(bufs.pop(i))  # so bufs[0] is always the longest-held one
                return buf.view(shape)
        self.allocated += 1
        buf = torch.empty(shape, dtype=dtype)
        if _USE_COUNT is None or self.per_key == 0:
            return buf
        if len(bufs) >= self.per_key:
            bufs.pop(0)  # the longest-held buffer stays with its consumer, out of the pool
        bufs.append(buf)
        return buf.view(shape)


class SlotLender:
    """Lends a decode slot's fields to the consumer as tensors over the shared memory the worker wrote
    (NV12 out on CPU: no copy out of the ring), and gives the slot back to the pool once nothing outside
    holds them (the storage use count, as HostPool). At most `limit` slots are out at once; past that
    (a consumer keeping batches), lend() returns None and the caller copies the batch out instead, so a
    kept batch never starves the workers of slots. The pool's ring is sized with `limit` extra slots."""

    def __init__(self, pool, limit: int):
        self.pool, self.limit = pool, limit
        # slot -> (uint8 tensor over the slot, its fields as (name, typed view of it, shape, stride, offset),
        # the storage's use count at rest): made once per slot, so a loan is one as_strided per field
        self._slots: dict[int, tuple] = {}
        self._out: set[int] = set()
        self.lent = 0  # batches handed out without a copy (a test and the benchmark read it)

    @staticmethod
    def available() -> bool:
        return _USE_COUNT is not None

    def reclaim(self) -> None:
        for slot in [s for s in self._out if _USE_COUNT(self._slots[s][0].untyped_storage()._cdata) ==
                     self._slots[s][2]]:
            self._out.discard(slot)
            self.pool.release(slot)

    def lend(self, slot: int) -> dict[str, torch.Tensor] | None:
        """The batch in `slot` as tensors viewing it, or None when `limit` slots are already out."""
        self.reclaim()
        if _USE_COUNT is None or len(self._out) >= self.limit:
            return None
        made = self._slots.get(slot) or self._make(slot)
        self._out.add(slot)
        self.lent += 1
        return {name: typed.as_strided(shape, stride, offset) for name, typed, shape, stride, offset in made[1]}

    def _make(self, slot: int) -> tuple:
        buf = self.pool.buffer(slot)
        # Through numpy, not torch.frombuffer: the array holds a buffer export of the shared memory for as
        # long as any lent tensor lives, so the pool's close() cannot unmap a batch its consumer still holds.
        base = torch.from_numpy(np.frombuffer(buf, np.uint8))
        typed, fields = {}, []
        for name, arr in self.pool.layout.views(buf).items():
            dtype, size = _TORCH_DTYPES[arr.dtype.str], arr.itemsize
            if dtype not in typed:
                typed[dtype] = base[: base.numel() // size * size].view(dtype)
            offset = arr.ctypes.data - base.data_ptr()  # fields are 64-byte aligned (batch.py)
            fields.append((name, typed[dtype], arr.shape, tuple(x // size for x in arr.strides), offset // size))
        made = self._slots[slot] = (base, fields, _USE_COUNT(base.untyped_storage()._cdata))
        return made

    def close(self) -> None:
        self._slots.clear()
        self._out.clear()


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(buf: torch.Tensor) -> bool:
    # 2 = the pool's tensor + the temporary storage object made by untyped_storage()
    return _USE_COUNT(buf.untyped_storage()._cdata) == 2


_TORCH_DTYPES = {np.dtype(np.uint8).str: torch.uint8, np.dtype(np.float32).str: torch.float32,
                 np.dtype(np.int64).str: torch.int64, np.dtype(np.bool_).str: torch.bool}


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    out: dict = {"frames": {}}
    for name, t in flat.items():
        if name.startswith("frames."):
            out["frames"][name.split(".", 1)[1]] = t
        else:
            out[name] = t
    return out


def _flat(tensors: dict) -> list[torch.Tensor]:
    return [t for k, v in tensors.items() for t in (v.values() if k == "frames" else [v])]
