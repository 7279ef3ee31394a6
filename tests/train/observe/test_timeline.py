"""GPU step accounting from a trace: interval arithmetic on synthetic
timelines, the five-way step partition, waiting on peers, and the CUDA-event step timer."""

import json

import pytest
import torch

from loongforge.train.observe import timeline as tl
from loongforge.train.observe.profiler import LateWriter, StepTimer, analyze_traces


def test_interval_arithmetic():
    assert tl.merge([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert tl.length([(0, 10), (2, 5), (8, 12), (20, 21)]) == 13
    assert tl.intersect([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == [(2, 4), (6, 7), (9, 10)]
    assert tl.subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert tl.subtract([(0, 2), (4, 6)], [(-1, 10)]) == []
    assert tl.clip([(0, 5), (8, 12), (20, 30)], 2, 10) == [(2, 5), (8, 10)]


def test_partition_overlapped_comm_is_not_a_wait():
    """All-reduce fully under a compute kernel on another stream (overlap_comm): 0 exposed."""
    p = tl.partition_step(0, 100, compute=[(0, 100)], comm=[(20, 60)])
    assert p["comm_exposed"] == 0 and p["comm_overlapped"] == 40 and p["compute"] == 100
    assert p["launch_overhead"] == 0 and p["data_wait"] == 0 and p["peer_wait"] is None


def test_partition_exposed_comm_data_wait_and_launch_gaps():
    # compute 10-40 and 60-70; comm 30-55 (10 overlapped, 15 exposed); host in next(loader) 0-8;
    # idle: 0-10 (8 of it data wait) and 55-60, 70-100 (launch overhead)
    p = tl.partition_step(0, 100, compute=[(10, 40), (60, 70)], comm=[(30, 55)], data_wait=[(0, 8)])
    assert p == {"step": 100, "compute": 40, "comm_exposed": 15, "peer_wait": None, "comm_overlapped": 10,
                 "data_wait": 8, "launch_overhead": 37}
    parts = ("compute", "comm_exposed", "data_wait", "launch_overhead")
    assert sum(p[k] for k in parts) == p["step"]


def test_partition_idle_step():
    p = tl.partition_step(0, 50, compute=[], comm=[])
    assert p["launch_overhead"] == 50 and p["compute"] == 0 and p["comm_exposed"] == 0


def test_peer_wait_from_durations_across_ranks():
    # Rank 1 arrived 30 late at the first collective: rank 0's kernel spun 30 longer.
    r0 = [(100, 150), (300, 310)]
    r1 = [(1130, 1150), (1300, 1312)]  # another clock: only durations are compared
    w0, w1 = tl.peer_wait_intervals([r0, r1])
    assert w0 == [(100, 130)] and w1 == [(1300, 1302)]  # the head of the kernel is the spin
    assert tl.peer_wait_intervals([r0]) is None  # one rank: not separable
    assert tl.peer_wait_intervals([r0, r1[:1]]) is None  # lists that do not match
    p = tl.partition_step(0, 400, compute=[(0, 100), (150, 300)], comm=r0, peer_wait=w0)
    assert p["peer_wait"] == 30 and p["comm_exposed"] == 30  # 60 exposed: 30 waiting, 30 transfer


def _x(name, ts, dur, cat):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1}


def test_two_rank_gpu_traces(tmp_path):
    """Rank 1 waited on data (its data-wait mark), so rank 0's all-reduce spun until it arrived."""
    steps = [_x("ProfilerStep#4", 0, 1000, "user_annotation")]
    r0 = steps + [_x("sgemm", 0, 400, "kernel"), _x("ncclDevKernel_AllReduce", 400, 500, "kernel"),
                  _x("ProfilerStep#4", 0, 900, "gpu_user_annotation"),  # kineto's GPU-side copy of the mark
                  _x("Memcpy HtoD (Pinned -> Device)", 900, 50, "gpu_memcpy")]  # a copy engine, not compute
    r1 = steps + [_x("loongforge:data_wait", 0, 300, "user_annotation"), _x("sgemm", 300, 400, "kernel"),
                  _x("ncclDevKernel_AllReduce", 700, 200, "kernel")]
    paths = []
    for r, ev in enumerate((r0, r1)):
        paths.append(str(tmp_path / f"rank{r}.json"))
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"traceEvents": ev}))
    a, b = (t["steps"][0] for t in analyze_traces(paths))
    assert a["step"] == 4 and a["peer_wait_s"] == pytest.approx(300e-6) and a["comm_exposed_s"] == pytest.approx(200e-6)
    assert a["launch_overhead_s"] == pytest.approx(100e-6) and a["comm_s"] == pytest.approx(500e-6)
    assert b["peer_wait_s"] == 0 and b["gpu_data_wait_s"] == pytest.approx(300e-6)
    assert b["launch_overhead_s"] == pytest.approx(100e-6) and b["compute_s"] == pytest.approx(400e-6)
    alone = analyze_traces(paths[:1])[0]["steps"][0]
    assert alone["peer_wait_s"] is None and alone["comm_s"] == pytest.approx(500e-6)


class _FakeEvent:
    """torch.cuda.Event stand-in: record() reads a fake GPU clock (ms)."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t


def test_cuda_step_timer_syncs_only_in_a_profile_window(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    timer = StepTimer(torch.device("cuda", 0))
    written = []
    late = LateWriter(written.append)
    for step, sync in enumerate((False, False, True)):
        timer.begin(sync=sync)
        for phase, ms in (("data_wait", 1.0), ("forward", 10.0), ("backward", 20.0), ("optimizer", 5.0)):
            with timer.phase(phase):
                _FakeEvent.clock += ms
        late.push(timer.stop(None), {"step": step})
        assert syncs == ([1, 1] if sync else [])  # device-wide only around a traced step
        assert len(written) == step  # one step late
    late.flush()
    rec = written[0]
    assert rec["forward_s"] == pytest.approx(0.010) and rec["backward_s"] == pytest.approx(0.020)
    assert rec["step_s"] == pytest.approx(0.036) and rec["timer"] == "cuda_events"
    assert rec["overhead_s"] == pytest.approx(0.036 - 0.035 - rec["data_wait_s"], abs=1e-3)
    assert written[2]["timer"] == "cuda_events_synced" and [r["step"] for r in written] == [0, 1, 2]


def test_cpu_step_timer_unchanged():
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    with timer.phase("forward"):
        pass
    rec = timer.end(0.0)
    assert rec["timer"] == "host" and rec["step_s"] >= rec["forward_s"] >= 0 and rec["comm_s"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_a_matmul():
    timer = StepTimer(torch.device("cuda", torch.cuda.current_device()))
    x = torch.randn(4096, 4096, device="cuda")
    timer.begin()
    with timer.phase("forward"):
        for _ in range(20):
            x = (x @ x).tanh_()
    rec = StepTimer.finish(timer.stop(None))
    assert rec["timer"] == "cuda_events" and 0 < rec["forward_s"] <= rec["step_s"]
