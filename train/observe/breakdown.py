"""`loongforge profile RUN_DIR`: the step-time breakdown table and chart.

Categories (the baseline's): data wait, communication, launch/dispatch
overhead, compute (and, on GPU when every rank's trace is here, waiting on
peers); mean seconds per step and % of the mean step, over the steps after
warm-up. One table per segment: a run resumed with another rank count has a
segment per rank count, and the first step of every launch is warm-up.
Sources: RUN_DIR/metrics.jsonl (host timers or CUDA events, every step)
and, when present, RUN_DIR/traces/rank*.json (torch.profiler chrome traces).
"""

from __future__ import annotations

import glob
import html
import json
import os

from loongforge.shared.errors import FormatError
from loongforge.train.observe.metrics import read_metrics
from loongforge.train.observe.profiler import analyze_traces

FOOTNOTE = (
    "data wait = time blocked in next(loader). communication = time inside collectives "
    "({comm_src}). compute = forward + backward + optimizer phases minus communication. "
    "launch/dispatch overhead = step wall time minus data wait, forward, backward and optimizer: the "
    "Python loop, noise sampling, host syncs and dispatch outside the timed phases. Per-step metric "
    "logging (one small all_gather, `log_s` in metrics.jsonl) and checkpoint saves fall outside the step "
    "wall time. "
)
TAIL = ("Means over steps {first}..{last} of this segment ({world} ranks); {skip} warm-up step(s) excluded "
        "(the first step of every launch, resumes included).")
GPU_FOOTNOTE = (
    "GPU: each instant of the traced steps ({n} rank-steps) is one of: compute (a non-communication kernel "
    "runs on some stream), communication (only collective kernels run: exposed; NCCL time under compute, "
    "{overlapped:.1f}% of the step, is overlapped and not counted), {peers}data wait (no kernel runs, the "
    "host is in next(loader)), launch/dispatch overhead (no kernel runs, the host is elsewhere: Python, "
    "dispatch, launch latency). Fractions of the traced steps (exposed NCCL kernel time etc.), applied "
    "to the mean step time from CUDA events. "
)
PEERS_YES = ("waiting on peers (the head of each collective that outlasts the same collective on the "
             "fastest rank: this rank spun until the last peer joined), ")
PEERS_NO = ("waiting on peers NOT separable here (it needs every rank's trace of the same steps in this "
            "run dir; single-node runs have them) and is inside communication, ")
GPU_KEYS = {"compute": "compute_s", "communication": "comm_exposed_s", "waiting on peers": "peer_wait_s",
            "data wait": "gpu_data_wait_s", "launch/dispatch overhead": "launch_overhead_s"}


def segments(rows: list[dict]) -> list[list[dict]]:
    """Runs of consecutive steps with the same rank count (a resume may change it)."""
    out: list[list[dict]] = []
    for r in rows:
        if out and out[-1][-1].get("world", 1) == r.get("world", 1):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def breakdown(run_dir: str) -> dict:
    """The last segment's breakdown at the top level, every segment's under "segments"."""
    rows = read_metrics(run_dir)
    if not rows:
        raise FormatError(f"{run_dir}/metrics.jsonl has no steps yet")
    traces = analyze_traces(sorted(glob.glob(os.path.join(run_dir, "traces", "rank*.json"))))
    parts = [_segment(run_dir, seg, traces) for seg in segments(rows)]
    out = dict(parts[-1])
    out.update(segments=parts, loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"])
    return out


def _segment(run_dir: str, rows: list[dict], traces: list[dict]) -> dict:
    # Warm-up: the segment's first step (legacy metrics) and the first step of every launch.
    warm = {rows[0]["step"]} | {r["step"] for r in rows if r.get("warmup")}
    use = [r for r in rows if r["step"] not in warm] or rows
    skip = len(rows) - len(use)
    steps_used = {r["step"] for r in use}

    def mean(key):
        vals = [r[key] for r in use if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    mine = [dict(t, steps=[s for s in t["steps"] if s.get("step") in steps_used or s.get("step") == -1])
            for t in traces]
    mine = [t for t in mine if t["steps"]]
    step = mean("step_s")
    gpu_steps = [s for t in mine if t["kind"] == "gpu" for s in t["steps"]]
    if gpu_steps:
        table, comm_src, gpu_note = _gpu_table(gpu_steps, step, rows[0].get("world", 1))
    else:
        table, comm_src = _host_table(use, mean, mine, step)
        gpu_note = ""
    return {
        "run_dir": run_dir, "steps": len(use), "first_step": rows[0]["step"], "last_step": rows[-1]["step"],
        "warmup_steps": sorted(warm), "step_s": step, "table": table,
        "percent": {k: 100.0 * v / step for k, v in table.items()},
        "samples_per_s": sum(r["samples"] for r in use) / sum(r["step_s"] for r in use),
        "world": rows[0].get("world", 1), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
        "comm_groups": comm_by_group(use),
        "traces": [{"path": t["path"], "kind": t["kind"], "comm_events": t["comm_events"],
                    "comm_event_count": t["comm_event_count"],
                    "comm_s_per_step": [s["comm_s"] for s in t["steps"]],
                    "step_s": [s["step_s"] for s in t["steps"]],
                    **({k: [s[k] for s in t["steps"]] for k in ("gpu_idle_s", "launch_overhead_s", "peer_wait_s",
                                                                  "comm_overlapped_s")} if t["kind"] == "gpu" else
                       {k: [s.get(k) for s in t["steps"]] for k in ("ops_s", "python_overhead_s")})}
                   for t in mine],
        "python_overhead_share": _python_share(mine),
        "footnote": (gpu_note or FOOTNOTE.format(comm_src=comm_src)) + TAIL.format(
            first=use[0]["step"], last=use[-1]["step"], skip=skip, world=rows[0].get("world", 1)),
    }


def _python_share(traces: list[dict]) -> float | None:
    """CPU traces: the fraction of the traced steps the host spent in Python between ATen ops (not
    blocked on data): the CPU's launch/dispatch overhead, which the host timers cannot separate from
    compute (on CPU the host both dispatches and computes). None without CPU traces."""
    steps = [s for t in traces if t["kind"] == "cpu" for s in t["steps"] if s.get("python_overhead_s") is not None]
    total = sum(s["step_s"] for s in steps)
    return sum(s["python_overhead_s"] for s in steps) / total if total else None


def comm_by_group(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Rank 0's collectives per step by group kind (tp / sp / dp / sp_dp / world), mean over the
    steps that recorded them (metrics' `comm_groups`, train/parallel/comm.py StepComm)."""
    have = [r["comm_groups"] for r in rows if "comm_groups" in r]
    out: dict[str, dict[str, float]] = {}
    for groups in have:
        for g, row in groups.items():
            acc = out.setdefault(g, dict.fromkeys(row, 0.0))
            for k, v in row.items():
                acc[k] += v / len(have)
    return out


def _host_table(use, mean, traces, step) -> tuple[dict, str]:
    comm, comm_src = mean("comm_s"), "deepspeed.comm op timers, host wall time"
    if comm is None:
        comm_src = "NOT measured: a CUDA run without --profile-steps traces; it is inside compute"
    comm = comm or 0.0
    busy = mean("forward_s") + mean("backward_s") + mean("optimizer_s")
    return {"data wait": mean("data_wait_s"), "communication": comm,
            "launch/dispatch overhead": mean("overhead_s"), "compute": max(0.0, busy - comm)}, comm_src


def _gpu_table(trace_steps: list[dict], step: float, world: int) -> tuple[dict, str, str]:
    total = sum(s["step_s"] for s in trace_steps)
    separable = all(s["peer_wait_s"] is not None for s in trace_steps)
    table = {}
    for name in ("data wait", "communication", "waiting on peers", "launch/dispatch overhead", "compute"):
        if name == "waiting on peers" and not separable:
            continue
        table[name] = step * sum(s[GPU_KEYS[name]] or 0.0 for s in trace_steps) / total
    overlapped = 100.0 * sum(s["comm_overlapped_s"] for s in trace_steps) / total
    peers = PEERS_YES if separable else ("" if world == 1 else PEERS_NO)  # one rank: no peer to wait on
    note = GPU_FOOTNOTE.format(n=len(trace_steps), overlapped=overlapped, peers=peers)
    return table, "exposed NCCL kernel time from the profiler traces", note


def format_table(b: dict) -> str:
    parts = b.get("segments") or [b]
    out = [_format_segment(seg, len(parts) > 1) for seg in parts]
    return "\n\n".join(out)


def _format_segment(b: dict, several: bool) -> str:
    where = f"steps {b['first_step']}..{b['last_step']}, " if several else ""
    lines = [f"step-time breakdown: {b['run_dir']}  ({where}{b['steps']} steps, {b['world']} ranks, "
             f"{b['samples_per_s']:.1f} samples/s, loss {b['loss_first']:.3f} -> {b['loss_last']:.3f})",
             f"{'phase':<28}{'seconds':>10}{'% of step':>11}", "-" * 49]
    for k, v in b["table"].items():
        lines.append(f"{k:<28}{v:>10.4f}{b['percent'][k]:>10.1f}%")
    lines.append("-" * 49)
    lines.append(f"{'step (mean)':<28}{b['step_s']:>10.4f}{sum(b['percent'].values()):>10.1f}%")
    for t in b["traces"]:
        per = ", ".join(f"{c * 1e3:.1f}" for c in t["comm_s_per_step"])
        lines.append(f"trace {os.path.basename(t['path'])} ({t['kind']}): {t['comm_event_count']} collective "
                     f"events {t['comm_events']}; comm ms/step [{per}]")
    if b.get("comm_groups"):
        lines.append("communication per step by group (rank 0; wire = bytes this rank sends, ring/pairwise):")
        lines.append(f"  {'group':<7}{'calls':>7}{'wire MB':>10}{'payload MB':>12}{'host s':>9}")
        for g, r in sorted(b["comm_groups"].items()):
            lines.append(f"  {g:<7}{r['calls']:>7.1f}{r['wire_bytes'] / 1e6:>10.3f}"
                         f"{r['payload_bytes'] / 1e6:>12.3f}{r['seconds']:>9.4f}")
    if b.get("python_overhead_share") is not None:
        lines.append(f"CPU trace: Python overhead (host between ATen ops, not blocked on data) "
                     f"{100 * b['python_overhead_share']:.1f}% of the traced steps; inside the phases above it is "
                     "counted as compute, the table's launch/dispatch overhead is only what falls outside them")
    lines.append("")
    lines.append("* " + b["footnote"])
    return "\n".join(lines)


def write_html(b: dict, run_dir: str) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4f}</td><td>{b['percent'][k]:.1f}%</td></tr>"
                   for k, v in b["table"].items())
    # A standalone page: the chart beside it by relative path; an empty icon, so a browser asks the
    # server (or file://) for no favicon.ico, whose 404 would be the page's one console error.
    doc = (f"<!doctype html><html lang=en><head><meta charset=utf-8><link rel=icon href='data:,'>"
           f"<title>step-time breakdown: {html.escape(b['run_dir'])}</title>"
           f"<style>img{{max-width:100%}}</style></head><body>"
           f"<h3>{html.escape(b['run_dir'])}</h3><table id=breakdown border=1><tr><th>phase</th><th>s</th>"
           f"<th>% of step</th></tr>{rows}</table><p>{html.escape(b['footnote'])}</p>"
           f"<img id=chart src='profile.png' alt='step-time breakdown chart'></body></html>")
    path = os.path.join(run_dir, "profile.html")
    with open(path, "w") as f:
        f.write(doc)
    return path


def to_json(b: dict) -> str:
    return json.dumps(b, indent=2, sort_keys=True)
