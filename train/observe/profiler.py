"""Where the milliseconds of a step go: per-step phase timers, optional
torch.profiler traces, and a chrome-trace parser for communication time.

Phases per optimizer step (StepTimer: host wall clock on CPU, CUDA events on
the compute stream read one step late on CUDA, no host sync outside a trace window):
  data_wait  blocked in next(loader)
  forward    engine(batch)            backward  engine.backward(loss)
  optimizer  engine.step()            comm      time inside deepspeed.comm
                                                collectives (also inside the
                                                three phases above)
Derived: compute = forward + backward + optimizer - comm;
overhead = step wall - data_wait - forward - backward - optimizer (the Python
loop, noise sampling, logging, checkpoint, host-side dispatch not inside a phase).

Traces: gloo collectives appear as CPU events (`gloo:all_reduce`, ...), NCCL as
GPU kernels (`ncclDevKernel_*`); we parse the JSON ourselves so both work. A GPU
trace's step is partitioned by timeline.py (exposed vs overlapped communication,
waiting on peers, data wait, launch overhead).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from loongforge.train.observe import timeline

# "inputs" (the processor: pixel values, colour jitter, padding on the training device) runs inside
# "forward" and is reported as its part, not beside it
PHASES = ("data_wait", "forward", "backward", "optimizer", "inputs")
COMM_CPU = re.compile(r"^(gloo|nccl|c10d|mpi)[:_]|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all",
                      re.I)
COMM_KERNEL = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv", re.I)
MARK_PREFIX = "loongforge:"  # our phase annotations in a trace (record_function names)


GPU_PHASES = ("forward", "backward", "optimizer", "inputs")


@dataclass
class StepTiming:
    """One step's timers, before the CUDA events are read (see StepTimer.finish)."""

    host: dict[str, float]
    wall: float
    comm_s: float | None
    events: dict | None = None  # CUDA: phase -> [(start, end)], plus "step" -> [(start, end)]
    synced: bool = False


class StepTimer:
    """Phase timers. CPU: host wall clock per phase. CUDA: CUDA events recorded on the compute
    stream around each GPU phase and around the step, read one step late (StepTimer.finish after
    the next step is dispatched, when they have long completed), so timing adds no host sync and
    the side-stream prefetch keeps overlapping. data_wait is always host time (blocked in
    next(loader)). Inside a --profile-steps window (begin(sync=True)) the step is bracketed by
    two device-wide syncs, so the trace's step range holds exactly that step's kernels; never
    outside it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.acc: dict[str, float] = {}
        self.t0 = 0.0
        self.synced = self.traced = False
        self._events: dict | None = None

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # on the current (compute) stream: the phase's own kernels, not the prefetch stream
        return ev

    def begin(self, sync: bool = False) -> None:
        self.traced = sync  # inside a --profile-steps window (CPU too: the trace marks the data wait)
        self.synced = sync and self.cuda
        if self.synced:
            torch.cuda.synchronize()
        self.acc = dict.fromkeys(PHASES, 0.0)
        self._events = {p: [] for p in (*GPU_PHASES, "step")} if self.cuda else None
        self.t0 = time.perf_counter()
        if self.cuda:
            self._step_start = self._event()

    @contextmanager
    def phase(self, name: str):
        gpu = self.cuda and name in GPU_PHASES
        start = self._event() if gpu else None
        # In a trace window the data wait is marked, so the trace can tell GPU idle on data from launch overhead.
        mark = torch.profiler.record_function(f"{MARK_PREFIX}{name}") if self.traced else nullcontext()
        t = time.perf_counter()
        try:
            with mark:
                yield
        finally:
            self.acc[name] += time.perf_counter() - t
            if gpu:
                self._events[name].append((start, self._event()))

    def end(self, comm_s: float | None) -> dict[str, float | None]:
        """stop() and finish() at once (CUDA: waits for the step's last event)."""
        return self.finish(self.stop(comm_s))

    def stop(self, comm_s: float | None) -> StepTiming:
        events = self._events
        if self.cuda:
            events["step"].append((self._step_start, self._event()))
        if self.synced:
            torch.cuda.synchronize()
        return StepTiming(host=dict(self.acc), wall=time.perf_counter() - self.t0, comm_s=comm_s, events=events,
                          synced=self.synced)

    @staticmethod
    def finish(t: StepTiming) -> dict[str, float | None]:
        """The step's record. CUDA: waits on that step's last event only (not device-wide); called one
        step late it does not wait at all. step_s is then the GPU's span of the step."""
        phases = dict(t.host)
        wall = t.wall
        out: dict[str, float | None] = {"timer": "host"}
        if t.events is not None:
            t.events["step"][-1][1].synchronize()
            for name in GPU_PHASES:
                phases[name] = sum(a.elapsed_time(b) for a, b in t.events[name]) / 1e3
            wall = t.events["step"][0][0].elapsed_time(t.events["step"][0][1]) / 1e3
            out = {"timer": "cuda_events_synced" if t.synced else "cuda_events", "host_step_s": t.wall}
        busy = phases["forward"] + phases["backward"] + phases["optimizer"]
        out.update({f"{k}_s": v for k, v in phases.items()})
        out["step_s"] = wall
        out["comm_s"] = t.comm_s
        out["compute_s"] = busy - (t.comm_s or 0.0)
        out["overhead_s"] = max(0.0, wall - phases["data_wait"] - busy)
        return out


class LateWriter:
    """Writes each step's record one step late, when its CUDA events are done (no stall); flush()
    before a checkpoint and at the end, so metrics.jsonl never lags a saved step."""

    def __init__(self, write):
        self.write, self.pending = write, None

    def push(self, timing: StepTiming, rec: dict) -> None:
        self.flush()
        self.pending = (timing, rec)

    def flush(self) -> None:
        if self.pending is not None:
            timing, rec = self.pending
            self.pending = None
            self.write({**rec, **StepTimer.finish(timing)})


class TraceWindow:
    """torch.profiler over steps [a, b); writes RUN_DIR/traces/rank{r}.json (chrome trace)."""

    def __init__(self, run_dir: str, rank: int, steps: tuple[int, int] | None, device: torch.device):
        self.steps, self.rank, self.prof = steps, rank, None
        self.path = os.path.join(run_dir, "traces", f"rank{rank}.json")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)

    @property
    def active(self) -> bool:
        return self.prof is not None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and self.prof is None:
            self.prof = torch.profiler.profile(activities=self.activities, record_shapes=False)
            self.prof.start()
        if self.prof is not None:
            # Our own step marker (the name HTA expects): without a schedule, prof.step() records none.
            self._mark = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._mark.__enter__()

    def after(self, step: int) -> None:
        if self.prof is None:
            return
        self._end_mark()
        if step + 1 >= self.steps[1]:
            self.close()

    def _end_mark(self) -> None:
        if getattr(self, "_mark", None) is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    def close(self) -> None:
        if self.prof is not None:
            self._end_mark()
            self.prof.stop()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.prof.export_chrome_trace(self.path)
            self.prof = None


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _iv(e: dict) -> tuple[float, float]:
    return (e["ts"], e["ts"] + e["dur"])


_HOST_CATS = ("cpu_op", "user_annotation", "")
_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# What an event is, from its (cat, name): bit flags, computed once per distinct pair.
_NAME, _MARK, _COMM_C, _OP, _DATA, _KERNEL, _COMM_K, _COMPUTE = (1 << i for i in range(8))


def _classify(cat, name: str) -> int:
    cat, kind = str(cat).lower(), 0
    if COMM_CPU.search(name):
        kind |= _NAME
    # Host-side marks only: kineto repeats each record_function on the GPU timeline ("gpu_user_annotation").
    if cat in _HOST_CATS:
        kind |= ((_MARK if name.startswith("ProfilerStep#") else 0) | (_COMM_C if COMM_CPU.search(name) else 0)
                 | (_DATA if name == f"{MARK_PREFIX}data_wait" else 0)
                 # Host time inside some ATen operator (its dispatch included); the rest of a CPU step that
                 # is not data wait is the Python around the ops: module calls, hooks, DeepSpeed's glue.
                 | (_OP if cat == "cpu_op" else 0))
    elif cat in _KERNEL_CATS:
        kind |= _KERNEL
        if COMM_KERNEL.search(name):
            kind |= _COMM_K | _NAME
        elif cat == "kernel":  # Compute = SM kernels. Copies run on copy engines (the prefetch's H2D
            kind |= _COMPUTE   # overlaps by design), so a copy alone does not make the step busy.
    return kind


def _parse(path: str) -> dict:
    """A trace's steps and, per step, its kernel / collective / data-wait intervals (microseconds).
    One pass over the events (a GPU trace holds millions), each distinct (cat, name) classified once."""
    events = load_trace(path)
    classes: dict[tuple, int] = {}
    lists = {bit: [] for bit in (_COMM_C, _OP, _DATA, _COMM_K, _COMPUTE)}
    marks, kernels = [], 0
    for e in events:
        key = (e.get("cat", ""), e["name"])
        kind = classes.get(key)
        if kind is None:
            kind = classes[key] = _classify(*key)
        if kind <= _NAME:
            continue
        iv = (e["ts"], e["ts"] + e["dur"])
        if kind & _KERNEL:
            kernels += 1
        if kind & _MARK:
            marks.append(e)
        for bit, out in lists.items():
            if kind & bit:
                out.append(iv)
    steps = [(int(e["name"].split("#", 1)[1]), *_iv(e)) for e in sorted(marks, key=lambda e: e["ts"])]
    if not steps and events:
        steps = [(-1, min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))]
    comm_k, comm_c = sorted(lists[_COMM_K]), lists[_COMM_C]
    return {"path": path, "kind": "gpu" if kernels else "cpu", "steps": steps, "comm_k": comm_k,
            "compute_k": lists[_COMPUTE], "comm_c": comm_c, "ops": lists[_OP], "data": lists[_DATA],
            "names": sorted({name for (_, name), kind in classes.items() if kind & _NAME}),
            "count": len(comm_k) + len(comm_c)}


def _peer_waits(parsed: list[dict]) -> dict[tuple[int, int], list]:
    """(trace number, step) -> that rank's waiting-on-peer intervals, where separable (timeline.peer_wait_intervals)."""
    gpu = [i for i, t in enumerate(parsed) if t["kind"] == "gpu"]
    by_step: dict[int, dict[int, list]] = {}
    for i in gpu:
        for n, lo, hi in parsed[i]["steps"]:
            by_step.setdefault(n, {})[i] = timeline.clip(parsed[i]["comm_k"], lo, hi)
    out = {}
    for n, per_rank in by_step.items():
        order = sorted(per_rank)
        waits = timeline.peer_wait_intervals([per_rank[i] for i in order])
        if waits is not None:
            out.update({(i, n): w for i, w in zip(order, waits)})
    return out


def analyze_traces(paths: list[str]) -> list[dict]:
    """Per trace (one per rank), per step, seconds. CPU traces (gloo): comm = union of the
    collective host events. GPU traces: the step partition of timeline.py (compute, exposed comm,
    waiting on peers, data wait, launch overhead) from the kernels of all streams; comm_s is the
    exposed communication (waiting on peers included), overlapped NCCL time is not counted.
    Waiting on peers needs every rank's trace of the same steps (a shared run dir); else None."""
    parsed = [_parse(p) for p in paths]
    waits = _peer_waits(parsed)
    out = []
    for i, t in enumerate(parsed):
        rows = []
        for n, lo, hi in t["steps"]:
            row = {"step": n, "step_s": (hi - lo) / 1e6}
            if t["kind"] == "gpu":
                part = timeline.partition_step(lo, hi, compute=t["compute_k"], comm=t["comm_k"], data_wait=t["data"],
                                               peer_wait=waits.get((i, n)))
                sec = {k: (v / 1e6 if v is not None else None) for k, v in part.items()}
                row.update(comm_s=sec["comm_exposed"] + (sec["peer_wait"] or 0.0), comm_exposed_s=sec["comm_exposed"],
                           peer_wait_s=sec["peer_wait"], comm_overlapped_s=sec["comm_overlapped"],
                           compute_s=sec["compute"], gpu_data_wait_s=sec["data_wait"],
                           launch_overhead_s=sec["launch_overhead"],
                           gpu_busy_s=sec["compute"] + sec["comm_exposed"] + (sec["peer_wait"] or 0.0),
                           gpu_idle_s=sec["data_wait"] + sec["launch_overhead"])
            else:
                row.update(_cpu_partition(t, lo, hi))
            rows.append(row)
        out.append({"path": t["path"], "kind": t["kind"], "steps": rows, "comm_events": t["names"],
                    "comm_event_count": t["count"]})
    return out


def _cpu_partition(t: dict, lo: float, hi: float) -> dict:
    """A CPU step's host time (seconds): in collectives, in other ATen ops, blocked on data, and the
    rest, Python overhead (the interpreter between ops: module __call__, hooks, DeepSpeed glue)."""
    comm = timeline.merge(timeline.clip(t["comm_c"], lo, hi))
    ops = timeline.merge(timeline.clip(t["ops"], lo, hi) + comm)
    data = timeline.subtract(timeline.clip(t["data"], lo, hi), ops)
    python = timeline.subtract([(lo, hi)], ops + data)
    return {"comm_s": timeline.length(comm) / 1e6, "ops_s": timeline.length(ops) / 1e6,
            "host_data_wait_s": timeline.length(data) / 1e6, "python_overhead_s": timeline.length(python) / 1e6}
