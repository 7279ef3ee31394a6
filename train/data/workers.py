"""Decode worker pool: shard bytes -> NV12 batches in shared-memory slots.

The main process sends only integers (batch number, slot, sample locations)
through multiprocessing queues; each worker opens the dataset itself (its own
ShardSource: mmap, zero-copy, or the cache client), zstd-decompresses blocks
straight into a slot of a ring of `multiprocessing.shared_memory` buffers, and
answers with a few integers. Frames are never pickled. `num_workers=0` fills the
same layout inline.

A dead worker is noticed within one poll interval (`is_alive()` on every
wait) and reported as DataWorkerError naming the worker and its exit code;
a worker that stops answering hits `timeout_s`. Nothing blocks forever.

Workers ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's TERM reaches the
whole process group, and the rank must still finish its step (and write its
checkpoint) with them; they leave when the rank closes the pool, or within a
second of the rank's death. A corrupt shard logs one WARNING at its first bad
sample and one summary line with its count when the pool closes (`BadSamples`),
not one line per sample.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import re
import signal
import threading
import time
import traceback
from collections import OrderedDict
from multiprocessing import get_context
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from loongforge.shared.errors import DataWorkerError, LoongForgeError
from loongforge.train.data.batch import BatchLayout
from loongforge.train.data.fill import FillerSpec

log = logging.getLogger(__name__)
POLL_S = 0.05
CLOSE_GRACE_S = 0.5  # how long close() lets workers finish their batch before killing them
# Batches in flight per worker before the next goes elsewhere, whatever its blocks. 3: of 2, 3, 4, 8 and no
# affinity, the fewest block decodes and the most samples/s (bench block-loader's output root, 2 workers).
AFFINITY_DEPTH = 3


class PoolClosedError(DataWorkerError):
    """get() was interrupted because the pool is closing (never seen by a caller that closes it)."""


def _worker_main(worker_id: int, filler_spec: FillerSpec, shm_names: list[str], policy: str, tasks, results,
                 ready=None) -> None:
    # Runs in a fresh (spawned) process: no torch import, own source, own mmaps.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank decides when its workers stop (close())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        filler = filler_spec.open()
        shms = [SharedMemory(name=n) for n in shm_names]
    except BaseException:  # noqa: BLE001 - report why we could not start, then exit non-zero
        results.put(("fatal", worker_id, -1, traceback.format_exc(limit=8)))
        raise SystemExit(3) from None
    if ready is not None:  # start-up done (imports, source, mmaps): DecodePool.wait_ready counts these
        with ready.get_lock():
            ready.value += 1
    parent = multiprocessing.parent_process()
    try:
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the trainer was killed: do not linger as an orphan
                continue
            if task is None:
                return
            seq, slot, items = task
            try:
                arrays = filler_spec.layout.views(shms[slot].buf)
                bad, reasons = filler.fill(arrays, items, policy)
                del arrays
                results.put(("ok", worker_id, seq, (slot, bad, reasons, filler.counters())))
            except LoongForgeError as exc:
                results.put(("error", worker_id, seq, f"{type(exc).__name__}: {exc}"))
            except Exception:  # noqa: BLE001 - a bug must surface in the trainer, with its traceback
                results.put(("error", worker_id, seq, traceback.format_exc(limit=8)))
    finally:
        filler.close()
        for shm in shms:
            try:
                shm.close()
            except BufferError:
                # A view of the slot outlives the loop: a retained exception's traceback (the cache client keeps
                # a corrupt shard's first error) holds the frames that filled it. The mapping goes with the
                # process, which is exiting; the main process unlinks the segment.
                pass


class DecodePool:
    """Ring of `slots` batch buffers filled by `num_workers` processes (or inline)."""

    def __init__(self, filler_spec: FillerSpec, *, num_workers: int, slots: int, policy: str = "skip",
                 timeout_s: float = 120.0, start_method: str = "spawn", affinity_blocks: int = 0):
        # Each worker (or the inline filler) opens the dataset itself from filler_spec: memory-mapped tables.
        self.layout: BatchLayout = filler_spec.layout
        self.policy = policy
        self.worker_counters: dict[int, dict] = {}  # worker id -> its block-cache counters
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.bad_samples = 0
        self.bad = BadSamples()
        self._free = list(range(slots))
        self._done: dict[int, tuple] = {}
        self._pending: dict[int, tuple] = {}  # inline mode: seq -> task
        self._shms: list[SharedMemory] = []
        self._unlinked = False  # the slots' names left /dev/shm once every worker had mapped them
        self._unlink_lock = threading.Lock()
        self._unlinker: threading.Thread | None = None
        self._procs = []
        self._closing = threading.Event()  # set by interrupt(): a blocked get() raises within POLL_S
        # Block affinity: each worker has its own task queue, and a batch goes to the worker whose block cache
        # most likely holds its blocks (a model of each worker's LRU over the keys it was sent, affinity_blocks
        # long), among those with fewer than AFFINITY_DEPTH batches in flight: the workers' caches add up,
        # where a shared queue would have every worker decode every block. 0 = round robin over the queues.
        self.affinity_blocks = affinity_blocks
        self._recent: list[OrderedDict] = [OrderedDict() for _ in range(num_workers)]
        self._inflight = [0] * num_workers
        self._next_worker = 0
        self._alive_at = -POLL_S  # when get() last checked the workers' liveness
        if num_workers == 0:
            self._bufs = [np.empty(self.layout.nbytes, np.uint8) for _ in range(slots)]
            self._filler = filler_spec.open()
            return
        self._filler = None
        self._shms = [SharedMemory(create=True, size=max(1, self.layout.nbytes)) for _ in range(slots)]
        self._bufs = [s.buf for s in self._shms]
        ctx = get_context(start_method)
        self._tasks, self._results = [ctx.Queue() for _ in range(num_workers)], ctx.Queue()
        self._ready = ctx.Value("i", 0)  # workers past start-up (a benchmark times only after all are)
        names = [s.name for s in self._shms]
        try:
            for wid in range(num_workers):
                p = ctx.Process(target=_worker_main, name=f"loongforge-decode-{wid}", daemon=True,
                                args=(wid, filler_spec, names, policy, self._tasks[wid], self._results, self._ready))
                p.start()
                self._procs.append(p)
            self._unlinker = threading.Thread(target=self._unlink_when_attached, name="loongforge-shm-unlink",
                                              daemon=True)
            self._unlinker.start()
        except BaseException:
            self.close()  # the shared-memory slots would outlive this process in /dev/shm otherwise
            raise

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def workers_ready(self) -> int:
        """Workers past start-up (imports, source, mmaps); 0 inline (no workers: wait_ready returns at once)."""
        return self._ready.value if self.num_workers else 0

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker is past start-up. A spawned worker imports numpy and
        the loader (~0.4-2 s on a loaded box) while the first-ready one already serves
        batches, so a throughput window opened before this measures start-up, not decoding.
        Raises DataWorkerError if a worker dies or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while self.workers_ready < self.num_workers:
            self._check_alive()
            if time.monotonic() > deadline:
                raise DataWorkerError(f"only {self.workers_ready} of {self.num_workers} data workers started "
                                      f"within {timeout_s:.0f} s")
            time.sleep(POLL_S / 5)

    def _unlink_when_attached(self) -> None:
        """Once every worker has mapped the slots, their names leave /dev/shm: the memory lives on
        while mapped and goes with the last process, so no kill of any process (a SIGKILL of the
        whole group included, which takes the resource tracker with it) can leave a segment behind.
        Runs in its own thread from the start (the consumer may be blocked elsewhere by then)."""
        while not self._closing.is_set():
            if self.workers_ready >= self.num_workers:
                self._unlink_names()
                return
            if any(not p.is_alive() for p in self._procs):
                return  # a worker died in start-up: close() unlinks
            time.sleep(POLL_S)

    def _unlink_names(self) -> None:
        with self._unlink_lock:
            if not self._unlinked:
                for shm in self._shms:
                    shm.unlink()
                self._unlinked = True

    def submit(self, seq: int, items: list[tuple[int, int, int]], keys=()) -> None:
        """Queue batch `seq`: items = [(sample id, episode row, t)], one per row; `keys`: the blocks it reads
        (any hashables), for the choice of worker (block affinity)."""
        if not self._free:
            raise DataWorkerError("no free batch slot: release() consumed batches before submitting more")
        slot = self._free.pop()
        task = (seq, slot, items)  # plain ints (the loader's plans: ndarray.tolist()): pickled small
        if self.num_workers == 0:
            self._pending[seq] = task
        else:
            wid = self._pick(keys)
            self._inflight[wid] += 1
            self._tasks[wid].put(task)

    def _pick(self, keys) -> int:
        """The worker for a batch reading `keys`: most of them in its modelled cache, among the workers with
        room (fewer than AFFINITY_DEPTH in flight; else the least loaded), ties to the least loaded, then
        round robin."""
        n = self.num_workers
        order = [(self._next_worker + i) % n for i in range(n)]
        self._next_worker = (self._next_worker + 1) % n
        room = [w for w in order if self._inflight[w] < AFFINITY_DEPTH] or \
            [min(order, key=lambda w: self._inflight[w])]
        if self.affinity_blocks <= 0 or not keys:
            return min(room, key=lambda w: self._inflight[w])
        best = max(room, key=lambda w: (sum(k in self._recent[w] for k in keys), -self._inflight[w]))
        recent = self._recent[best]
        for k in keys:
            recent[k] = True
            recent.move_to_end(k)
        while len(recent) > self.affinity_blocks:
            recent.popitem(last=False)
        return best

    def get(self, seq: int, out=None) -> tuple[int, dict[str, np.ndarray]]:
        """Wait for batch `seq`; returns (slot, arrays viewing the slot). Call release(slot) after use.
        `out` (inline only): a writable buffer of `layout.nbytes` filled instead of the slot, so the
        caller's own output memory receives the batch with no copy out of the ring."""
        if self.num_workers == 0:
            _, slot, items = self._pending.pop(seq)
            arrays = self.layout.views(self._bufs[slot] if out is None else out)
            try:
                bad, reasons = self._filler.fill(arrays, items, self.policy)
            except BaseException:
                self._free.append(slot)
                raise
            self._finish(slot, bad, reasons, 0, self._filler.counters())
            return slot, arrays
        if out is not None:
            raise ValueError("get(out=...) fills inline only: workers write into their shared-memory slots")
        now = time.monotonic()
        deadline = now + self.timeout_s
        # Checked on every call (at most once per POLL_S: a waitpid per worker), not only on a timeout: the
        # surviving workers would otherwise absorb a dead one's share and the death would go unnoticed.
        if now - self._alive_at >= POLL_S:
            self._check_alive()
            self._alive_at = now
        while seq not in self._done:
            if self._closing.is_set():
                raise PoolClosedError("decode pool is closing")
            try:
                kind, wid, rseq, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise DataWorkerError(f"no decoded batch for {self.timeout_s:.0f} s (data.worker_timeout_s): "
                                          f"workers alive={[p.is_alive() for p in self._procs]}") from None
                continue
            if kind == "fatal":
                raise DataWorkerError(f"data worker {wid} failed to start:\n{payload}")
            self._inflight[wid] -= 1
            if kind == "error":
                raise DataWorkerError(f"data worker {wid} failed on batch {rseq}: {payload}")
            self._done[rseq] = (*payload[:3], (wid, payload[3]))
        slot, bad, reasons, counters = self._done.pop(seq)
        return self._finish(slot, bad, reasons, *counters)

    def _finish(self, slot, bad, reasons, wid=0, counters=None):
        if counters is not None:
            self.worker_counters[wid] = counters
        if bad:
            self.bad_samples += bad
            self.bad.add(reasons)
        return slot, self.layout.views(self._bufs[slot])

    def _check_alive(self) -> None:
        for wid, p in enumerate(self._procs):
            if not p.is_alive():
                if (p.exitcode or 0) < 0:
                    why = f" (killed by signal {-p.exitcode}); check dmesg for the OOM killer or lower --workers"
                else:  # it raised before our worker loop could report: its traceback went to stderr
                    why = ("; its traceback is on stderr above. If it died at start: workers are spawned and "
                           "re-import the main module, so a script that makes a BlockLoader with workers must "
                           "do so under `if __name__ == '__main__':`")
                raise DataWorkerError(f"data worker {wid} (pid {p.pid}) died with exit code {p.exitcode}{why}")

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def buffer(self, slot: int):
        """The slot's bytes (shared memory with workers): what SlotLender lends without a copy."""
        return self._bufs[slot]

    def interrupt(self) -> None:
        """Make a get() blocked in another thread raise PoolClosedError within POLL_S (close() first step)."""
        self._closing.set()

    def close(self) -> None:
        self._closing.set()
        self.bad.summarize()
        if self._filler is not None:
            self._filler.close()
            self._filler = None
        for q in self._tasks if self._procs else ():
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001 - queue may be broken if a worker died mid-put
                pass
        # One shared deadline, not one per worker: a worker stuck in a read (slow origin, stopped
        # process) is killed, so close() is bounded by ~CLOSE_GRACE_S whatever the workers do.
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()  # SIGKILL: also ends a stopped process, where SIGTERM would stay pending
                p.join(timeout=2.0)
        self._procs = []
        self._bufs = []
        for shm in self._shms:
            _close_or_leave(shm)
        if self._unlinker is not None:
            self._unlinker.join(timeout=1.0)  # _closing is set: it leaves within POLL_S
        self._unlink_names()
        self._shms = []
        if self.num_workers:
            for q in (*self._tasks, self._results):
                q.cancel_join_thread()
                q.close()


def _close_or_leave(shm: SharedMemory) -> None:
    """Close a slot, or, while a consumer still holds a batch lent out of it (SlotLender: a numpy export
    of the mapping), leave the mapping to that batch: it is unmapped when the last tensor over it goes.
    Dropping our references also keeps SharedMemory.__del__ from retrying the close at exit and printing
    a BufferError."""
    try:
        shm.close()
    except BufferError:
        shm._buf = shm._mmap = None  # noqa: SLF001 - the export keeps the memoryview and mmap alive


class BadSamples:
    """Skipped samples grouped by their shard (or, without one in the reason, by the error): one WARNING at
    a group's first sample, one summary line per group with its count and sample ids at `summarize()`. A
    truncated shard skips every sample it holds: hundreds of identical lines would bury everything else."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}
        self.ids: dict[str, set[int]] = {}

    def add(self, reasons: list[str]) -> None:
        for reason in reasons:
            key = _group(reason)
            n = self.counts.get(key, 0)
            self.counts[key] = n + 1
            m = re.match(r"sample (\d+) ", reason)
            if m:
                self.ids.setdefault(key, set()).add(int(m.group(1)))
            if n == 0:
                self.first[key] = reason
                log.warning("skipped bad sample (data.bad_samples='skip'): %s; further bad samples from %s are "
                            "counted, with one summary line when the loader closes", reason, key)

    def summarize(self) -> None:
        for key, n in sorted(self.counts.items()):
            log.warning("skipped %d bad sample%s from %s (data.bad_samples='skip'; sample ids %s); the first: %s",
                        n, "" if n == 1 else "s", key, id_ranges(sorted(self.ids.get(key, ()))) or "unknown",
                        self.first[key])
        self.counts.clear()
        self.ids.clear()


def id_ranges(ids: list[int]) -> str:
    """Sorted ids as "3-7, 9": the summary line names every skipped sample in little space."""
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _group(reason: str) -> str:
    """The shard a bad sample's reason names, else its error without the sample's own id and position."""
    m = re.search(r"(\S+\.tar)\b", reason)
    if m:
        return m.group(1)
    return re.sub(r"^sample \d+ \([^)]*\): ", "", reason)
