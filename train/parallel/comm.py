"""Per-group communication accounting: every collective, by group kind
(tp / sp / dp / sp_dp / world), op and bytes, with host time.

Two ways in:
  * the parallel modules call the wrappers here (all_reduce, all_to_all_single...),
    which count into the active counter and call torch.distributed;
  * `patch_torch_distributed(counter)` wraps the torch.distributed functions
    themselves, so collectives issued by DeepSpeed (deepspeed/comm/torch.py looks
    `torch.distributed.<op>` up at call time) are counted too. The wrappers call
    the saved originals, so nothing is counted twice.

Bytes: `payload` is the tensor bytes handed to the op; `wire` is what this rank
sends with the bandwidth-optimal algorithm (ring / pairwise), W = group size:
    all_reduce 2(W-1)/W * n    all_gather (W-1) * n_in    reduce_scatter (W-1)/W * n_in
    all_to_all (W-1)/W * n     broadcast n (source)
Host time is the call's wall time: on gloo (synchronous) it is the comm time;
on NCCL it is only the launch cost and the profiler trace gives the kernel time.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

_GROUP_NAMES: dict[int, str] = {}
_ORIG = {op: getattr(dist, op) for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                         "all_to_all_single", "broadcast", "all_gather")}
_COUNTER: "CommCounter | None" = None


def register_group(pg, name: str) -> None:
    _GROUP_NAMES[id(pg)] = name


def clear_groups() -> None:
    _GROUP_NAMES.clear()


def group_name(pg) -> str:
    if pg is None:
        pg = dist.group.WORLD
    return _GROUP_NAMES.get(id(pg), "world" if pg is dist.group.WORLD else "other")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wire(op: str, n: int, w: int) -> float:
    if w <= 1:
        return 0.0
    return {"all_reduce": 2 * (w - 1) / w * n, "all_gather_into_tensor": (w - 1) * n,
            "all_gather": (w - 1) * n, "reduce_scatter_tensor": (w - 1) / w * n,
            "all_to_all_single": (w - 1) / w * n, "broadcast": float(n)}[op]


class CommCounter:
    """Totals of collectives by (group kind, op); `step()` marks a training step."""

    def __init__(self):
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps = 0

    def record(self, op: str, group, nbytes: int, seconds: float = 0.0) -> None:
        key = (group_name(group), op)
        w = dist.get_world_size(group) if dist.is_initialized() else 1
        self.calls[key] += 1
        self.payload[key] += nbytes
        self.wire[key] += _wire(op, nbytes, w)
        self.seconds[key] += seconds

    def step(self) -> None:
        self.steps += 1

    def by_group(self) -> dict[str, dict[str, float]]:
        """group kind -> {calls, payload_bytes, wire_bytes, seconds} per step (per call if no step marked)."""
        per = max(self.steps, 1)
        out: dict[str, dict[str, float]] = {}
        for (g, _op), n in self.calls.items():
            row = out.setdefault(g, {"calls": 0.0, "payload_bytes": 0.0, "wire_bytes": 0.0, "seconds": 0.0})
            row["calls"] += n / per
            row["payload_bytes"] += self.payload[(g, _op)] / per
            row["wire_bytes"] += self.wire[(g, _op)] / per
            row["seconds"] += self.seconds[(g, _op)] / per
        return out

    def report(self) -> str:
        lines = [f"communication per step (rank {dist.get_rank() if dist.is_initialized() else 0}, "
                 f"{self.steps} steps)", "group    calls   wire MB  payload MB   host s"]
        for g, r in sorted(self.by_group().items()):
            lines.append(f"{g:<7} {r['calls']:>6.1f} {r['wire_bytes'] / 1e6:>9.3f} "
                         f"{r['payload_bytes'] / 1e6:>11.3f} {r['seconds']:>8.4f}")
        return "\n".join(lines)


@contextlib.contextmanager
def counting(counter: CommCounter):
    """Count the collectives of the parallel modules into `counter` while inside."""
    global _COUNTER
    prev, _COUNTER = _COUNTER, counter
    try:
        yield counter
    finally:
        _COUNTER = prev


def _call(name: str, nbytes: int, args: tuple, kwargs: dict):
    t0 = time.perf_counter()
    out = _ORIG[name](*args, **kwargs)
    if _COUNTER is not None:
        _COUNTER.record(name, kwargs.get("group"), nbytes, time.perf_counter() - t0)
    return out


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM):
    return _call("all_reduce", _nbytes(t), (t,), {"op": op, "group": group})


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group):
    return _call("all_gather_into_tensor", _nbytes(inp), (out, inp), {"group": group})


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group):
    return _call("reduce_scatter_tensor", _nbytes(inp), (out, inp), {"group": group})


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group):
    return _call("all_to_all_single", _nbytes(inp), (out, inp), {"group": group})


def broadcast(t: torch.Tensor, src: int, group):
    return _call("broadcast", _nbytes(t), (t,), {"src": src, "group": group})


_INPUT = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor",
          "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input", "all_to_all_single": "input"}


class _TimedWork:
    """An async collective's handle whose wait() adds its blocked time to the counter. ZeRO-3
    gathers parameters with async_op=True and waits in its fetch hook: without this, the wait
    (the transfer, or a late peer) would land in compute and only the launch would count."""

    def __init__(self, work, counter: CommCounter, key: tuple[str, str]):
        self._work, self._counter, self._key = work, counter, key

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._counter.seconds[self._key] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _patched(op: str, fn):
    sig = inspect.signature(_ORIG[op])

    def wrapper(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs).arguments  # DeepSpeed passes tensor=..., others positionally
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        counter = _COUNTER
        if counter is not None:
            counter.record(op, bound.get("group"), _nbytes(bound[_INPUT[op]]), time.perf_counter() - t0)
            if bound.get("async_op") and out is not None:
                out = _TimedWork(out, counter, (group_name(bound.get("group")), op))
        return out

    wrapper.__name__ = op
    return wrapper


@contextlib.contextmanager
def patch_torch_distributed(counter: CommCounter):
    """Also count collectives that other code (DeepSpeed) issues through torch.distributed."""
    saved = [(dist, op, op, getattr(dist, op)) for op in _ORIG]  # (object, attribute, op, original)
    # DeepSpeed's backend binds two of them at init (deepspeed/comm/torch.py); patch those too.
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    for attr, op in (("all_gather_function", "all_gather_into_tensor"),
                     ("reduce_scatter_function", "reduce_scatter_tensor")):
        if cdb is not None and getattr(cdb, attr, None) is _ORIG[op]:
            saved.append((cdb, attr, op, _ORIG[op]))
    for obj, attr, op, fn in saved:
        setattr(obj, attr, _patched(op, fn))
    try:
        with counting(counter):
            yield counter
    finally:
        for obj, attr, _op, fn in saved:
            setattr(obj, attr, fn)


class StepComm:
    """Every collective of each training step, by group kind (tp / sp / dp / sp_dp / world): the
    parallel modules' own and DeepSpeed's, through patch_torch_distributed, installed once
    for the run. `begin()` at the start of a step drops whatever ran between steps (metric
    gathers, checkpoint saves, evaluation); `end()` returns this rank's
    {group: {calls, payload_bytes, wire_bytes, seconds}}. Host-side bookkeeping only, no device
    sync: on NCCL `seconds` is the launch time, the kernel time is in the profiler trace."""

    def __init__(self):
        self._counter = CommCounter()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(patch_torch_distributed(self._counter))

    def begin(self) -> None:
        for d in (self._counter.calls, self._counter.payload, self._counter.wire, self._counter.seconds):
            d.clear()
        self._counter.steps = 0

    def end(self) -> dict:
        self._counter.step()
        return {g: {k: round(v, 6) for k, v in row.items()} for g, row in self._counter.by_group().items()}

    def close(self) -> None:
        self._stack.close()
