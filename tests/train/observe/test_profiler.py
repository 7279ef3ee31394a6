import json

import pytest

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.observe import timeline
from loongforge.train.observe.profiler import analyze_traces


def _x(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1}


def test_union_of_nested_and_overlapping_intervals():
    assert timeline.length([(0, 10), (2, 5), (8, 12), (20, 21)]) == 13


def test_gpu_trace_nccl_kernels_and_idle(tmp_path):
    """Hand-written NCCL timeline (narrow unit test of the parser): two steps of 1000 us."""
    events = [_x("ProfilerStep#0", 0, 1000, "user_annotation"), _x("ProfilerStep#1", 1000, 1000, "user_annotation"),
              _x("aten::mm", 10, 50), _x("ampere_sgemm_128x64", 100, 300, "kernel"),
              _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 350, 200, "kernel"),  # overlaps compute by 50 us
              _x("ampere_sgemm_128x64", 1100, 400, "kernel"),
              _x("ncclDevKernel_ReduceScatter_Sum_bf16", 1600, 100, "kernel")]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = analyze_traces([str(path)])[0]
    assert t["kind"] == "gpu"
    s0, s1 = t["steps"]
    # Exposed communication only: the 50 us of the all-reduce under the sgemm is overlapped, not a wait.
    assert s0["comm_s"] == pytest.approx(150e-6) and s1["comm_s"] == pytest.approx(100e-6)
    assert s0["comm_overlapped_s"] == pytest.approx(50e-6)
    assert s0["gpu_busy_s"] == pytest.approx(450e-6) and s0["gpu_idle_s"] == pytest.approx(550e-6)
    assert s1["gpu_idle_s"] == pytest.approx(500e-6)
    assert "ncclDevKernel_AllReduce_Sum_f32_RING_LL" in t["comm_events"]


def test_cpu_trace_gloo_events(tmp_path):
    events = [_x("ProfilerStep#3", 0, 1000, "user_annotation"), _x("c10d::allreduce_", 100, 300),
              _x("gloo:all_reduce", 120, 250, "user_annotation"), _x("aten::addmm", 500, 100)]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = analyze_traces([str(path)])[0]
    assert t["kind"] == "cpu" and t["steps"][0]["comm_s"] == pytest.approx(300e-6)
    assert "gloo:all_reduce" in t["comm_events"]


def test_checkpoint_sidecar_and_latest_pointer_are_checked(tmp_path):
    run = str(tmp_path)
    assert ckpt_files.latest_tag(run) is None
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step00000005")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        ckpt_files.latest_tag(run)
    (root / "step00000005").mkdir()
    assert ckpt_files.latest_tag(run) == "step00000005"
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt_files.read_sidecar(run, "step00000005")
    (root / "step00000005" / ckpt_files.SIDECAR).write_text(json.dumps({"format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version 99"):
        ckpt_files.read_sidecar(run, "step00000005")
    (root / "step00000005" / ckpt_files.SIDECAR).write_text("{truncated")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ckpt_files.read_sidecar(run, "step00000005")


def test_report_uses_nccl_trace_when_host_did_not_time_comm(tmp_path):
    """A CUDA run logs comm_s=None (host timing would serialize overlap_comm); the table then comes
    from the trace's step partition (kernel intervals), as fractions of the mean step."""
    from loongforge.train.observe import breakdown as report

    rows = [{"v": 1, "step": i, "step_s": 0.1, "data_wait_s": 0.01, "forward_s": 0.03, "backward_s": 0.04,
             "optimizer_s": 0.01, "comm_s": None, "compute_s": 0.08, "overhead_s": 0.01, "loss": 1.0,
             "samples": 8, "world": 2} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "traces").mkdir()
    events = [_x("ProfilerStep#1", 0, 1000, "user_annotation"), _x("sgemm", 0, 500, "kernel"),
              _x("ncclDevKernel_AllReduce", 600, 250, "kernel"), _x("loongforge:data_wait", 500, 40, "user_annotation")]
    (tmp_path / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    b = report.breakdown(str(tmp_path))
    assert b["table"]["communication"] == pytest.approx(0.025)  # 25% of a 0.1 s step
    assert b["table"]["compute"] == pytest.approx(0.05)
    assert b["table"]["data wait"] == pytest.approx(0.004)  # GPU idle while the host waited on data
    assert b["table"]["launch/dispatch overhead"] == pytest.approx(0.021)  # the rest of the GPU idle time
    assert sum(b["percent"].values()) == pytest.approx(100.0)
    assert "waiting on peers" not in b["table"] and "NOT separable" in b["footnote"]  # one rank's trace only
    assert "exposed NCCL kernel time" in b["footnote"]
    assert "gpu" in report.format_table(b)
    (tmp_path / "traces" / "rank0.json").unlink()
    assert "NOT measured" in report.breakdown(str(tmp_path))["footnote"]


def test_cpu_trace_separates_python_overhead_from_ops_and_data_wait(tmp_path):
    """CPU: the host both dispatches and computes, so the Python between ATen ops is measured from
    the trace: step 1000 us = data wait 100 (an op inside it counts as op) + ops 300 (nested ones once)
    + collective 200 + Python 400."""
    from loongforge.train.observe import breakdown as report

    events = [_x("ProfilerStep#2", 0, 1000, "user_annotation"), _x("loongforge:data_wait", 0, 100, "user_annotation"),
              _x("aten::copy_", 50, 30), _x("aten::addmm", 150, 270), _x("aten::mm", 200, 100),
              _x("c10d::allreduce_", 500, 200), _x("gloo:all_reduce", 520, 150, "user_annotation")]
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    s = analyze_traces([str(tmp_path / "traces" / "rank0.json")])[0]["steps"][0]
    assert s["comm_s"] == pytest.approx(200e-6) and s["ops_s"] == pytest.approx(500e-6)
    assert s["host_data_wait_s"] == pytest.approx(70e-6) and s["python_overhead_s"] == pytest.approx(430e-6)
    rows = [{"v": 1, "step": i, "step_s": 0.001, "data_wait_s": 1e-4, "forward_s": 3e-4, "backward_s": 4e-4,
             "optimizer_s": 1e-4, "comm_s": 2e-4, "compute_s": 6e-4, "overhead_s": 1e-4, "loss": 1.0,
             "samples": 8, "world": 1} for i in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    b = report.breakdown(str(tmp_path))
    assert b["python_overhead_share"] == pytest.approx(0.43)
    assert "Python overhead (host between ATen ops, not blocked on data) 43.0%" in report.format_table(b)


class _Event(dict):
    """A trace event that counts comparisons with other events: a parser that looks events up in
    a list (`e in kernels`) compares each against the whole list, quadratic in the trace size."""

    compared = 0
    budget = 0

    def __eq__(self, other):
        _Event.compared += 1
        if _Event.compared > _Event.budget:
            raise AssertionError(f"more than {_Event.budget} event comparisons: the parse is not linear")
        return dict.__eq__(self, other)

    __hash__ = None


def test_million_event_trace_parses_in_linear_time(tmp_path, monkeypatch):
    """A GPU trace of 1 M events (5 profiled steps; kernels, NCCL, copies, host ops, gloo-like
    names), held in memory so JSON decoding is not what is measured. Linear: no event is compared
    with another; the wall time is an upper bound with a wide margin (~1 s here)."""
    import time

    from loongforge.train.observe import profiler

    n, steps = 1_000_000, 5
    per = n // steps
    kinds = [("aten::mm", "cpu_op"), ("ampere_sgemm_128x64", "kernel"), ("Memcpy HtoD", "gpu_memcpy"),
             ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "kernel"), ("c10d::allreduce_", "cpu_op")]
    events = [_Event(ph="X", name=f"ProfilerStep#{s}", ts=s * per, dur=per, cat="user_annotation")
              for s in range(steps)]
    events += [_Event(ph="X", name=kinds[i % 5][0], ts=i, dur=2, cat=kinds[i % 5][1]) for i in range(n - steps)]
    monkeypatch.setattr(profiler, "load_trace", lambda path: events)
    _Event.compared, _Event.budget = 0, n
    t0 = time.perf_counter()
    t = profiler.analyze_traces(["rank0.json"])[0]
    elapsed = time.perf_counter() - t0
    assert _Event.compared == 0
    assert t["kind"] == "gpu" and [r["step"] for r in t["steps"]] == list(range(steps))
    assert t["comm_event_count"] == 2 * ((n - steps) // 5)
    assert t["comm_events"] == ["c10d::allreduce_", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert elapsed < 15.0, f"{elapsed:.1f} s for {n} events"  # linear: ~3 s here; the count above is the check
