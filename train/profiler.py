"""Where the milliseconds of a step go: per-step phase timers, optional
torch.profiler traces, and a chrome-trace parser for communication time.

Phases timed on the host per optimizer step (CUDA: synchronized at phase
edges, so each phase's GPU work is inside it; this costs a sync per phase):
  data_wait  blocked in next(loader)
  forward    engine(batch)            backward  engine.backward(loss)
  optimizer  engine.step()            comm      time inside deepspeed.comm
                                                collectives (also inside the
                                                three phases above)
Derived: compute = forward + backward + optimizer - comm;
overhead = step wall - data_wait - forward - backward - optimizer (the Python
loop, noise sampling, logging, checkpoint, host-side dispatch not inside a phase).

Traces: gloo collectives appear as CPU events (`gloo:all_reduce`, ...), NCCL as
GPU kernels (`ncclDevKernel_*`); we parse the JSON ourselves so both work.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from contextlib import contextmanager

import torch

PHASES = ("data_wait", "forward", "backward", "optimizer")
COMM_CPU = re.compile(r"^(gloo|nccl|c10d|mpi)[:_]|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all",
                      re.I)
COMM_KERNEL = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv", re.I)


class StepTimer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.acc: dict[str, float] = {}
        self.t0 = 0.0

    def begin(self) -> None:
        self.acc = dict.fromkeys(PHASES, 0.0)
        self.t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        if self.sync:
            self.sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.acc[name] += time.perf_counter() - t

    def end(self, comm_s: float | None) -> dict[str, float | None]:
        wall = time.perf_counter() - self.t0
        out = {f"{k}_s": v for k, v in self.acc.items()}
        busy = self.acc["forward"] + self.acc["backward"] + self.acc["optimizer"]
        out["step_s"] = wall
        out["comm_s"] = comm_s
        out["compute_s"] = busy - (comm_s or 0.0)
        out["overhead_s"] = max(0.0, wall - self.acc["data_wait"] - busy)
        return out


class TraceWindow:
    """torch.profiler over steps [a, b); writes RUN_DIR/traces/rank{r}.json (chrome trace)."""

    def __init__(self, run_dir: str, rank: int, steps: tuple[int, int] | None, device: torch.device):
        self.steps, self.rank, self.prof = steps, rank, None
        self.path = os.path.join(run_dir, "traces", f"rank{rank}.json")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)

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


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(intervals, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def analyze_trace(path: str) -> dict:
    """Per-step communication and kernel time from a chrome trace (microseconds in, seconds out).

    comm: union of collective intervals: CPU events for gloo (blocking, on the
    host), GPU kernels for NCCL. gpu_busy / gpu_idle only for traces with kernels:
    idle = step - union(all kernels), i.e. time the GPU waited on the host
    (data, Python, launch latency), the honest "launch/dispatch overhead" on GPU."""
    events = load_trace(path)
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#"))
    kernels = [e for e in events if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm_k = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if COMM_KERNEL.search(e["name"])]
    comm_c = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if str(e.get("cat", "")).lower() in ("cpu_op", "user_annotation", "") and COMM_CPU.search(e["name"])]
    all_k = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    names = sorted({e["name"] for e in events if COMM_CPU.search(e["name"]) or
                    (e in kernels and COMM_KERNEL.search(e["name"]))})
    if not steps and events:
        steps = [(min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))]
    rows = []
    for lo, hi in steps:
        comm = _union(_clip(comm_k, lo, hi)) if comm_k else _union(_clip(comm_c, lo, hi))
        row = {"step_s": (hi - lo) / 1e6, "comm_s": comm / 1e6}
        if all_k:
            busy = _union(_clip(all_k, lo, hi))
            row.update(gpu_busy_s=busy / 1e6, gpu_idle_s=(hi - lo - busy) / 1e6)
        rows.append(row)
    return {"path": path, "kind": "gpu" if all_k else "cpu", "steps": rows, "comm_events": names,
            "comm_event_count": len(comm_k) + len(comm_c)}
