"""`loongforge profile RUN_DIR`: the step-time breakdown table and chart.

Categories (the baseline's): data wait, communication, launch/dispatch
overhead, compute; mean seconds per step and % of the mean step, over the
steps after warm-up. Sources: RUN_DIR/metrics.jsonl (host timers, every step)
and, when present, RUN_DIR/traces/rank*.json (torch.profiler chrome traces).
"""

from __future__ import annotations

import glob
import html
import json
import os

from loongforge.shared.errors import FormatError
from loongforge.train.metrics import read_metrics
from loongforge.train.profiler import analyze_trace

FOOTNOTE = (
    "data wait = time blocked in next(loader). communication = time inside collectives "
    "({comm_src}). compute = forward + backward + optimizer phases minus communication. "
    "launch/dispatch overhead = step wall time minus data wait, forward, backward and optimizer: the "
    "Python loop, noise sampling, host syncs and dispatch outside the timed phases. Per-step metric "
    "logging (one small all_gather, `log_s` in metrics.jsonl) and checkpoint saves fall outside the step "
    "wall time. {gpu_note}Means over steps {first}..{last} (the first {skip} step(s) are warm-up and excluded)."
)


def breakdown(run_dir: str) -> dict:
    rows = read_metrics(run_dir)
    if not rows:
        raise FormatError(f"{run_dir}/metrics.jsonl has no steps yet")
    skip = 1 if len(rows) > 1 else 0
    use = rows[skip:]
    n = len(use)

    def mean(key):
        vals = [r[key] for r in use if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    traces = [analyze_trace(p) for p in sorted(glob.glob(os.path.join(run_dir, "traces", "rank*.json")))]
    step = mean("step_s")
    comm, comm_src = mean("comm_s"), "deepspeed.comm op timers, host wall time"
    gpu_note = ""
    trace_steps = [s for t in traces for s in t["steps"]]
    if comm is None and trace_steps:
        # CUDA runs do not time collectives on the host (that would serialize overlap_comm): use the trace.
        frac = sum(s["comm_s"] for s in trace_steps) / sum(s["step_s"] for s in trace_steps)
        comm, comm_src = frac * step, "NCCL kernel time from the profiler traces, as a fraction of the step"
    elif comm is None:
        comm_src = "NOT measured: a CUDA run without --profile-steps traces; it is inside compute"
    comm = comm or 0.0
    busy = mean("forward_s") + mean("backward_s") + mean("optimizer_s")
    if any(t["kind"] == "gpu" for t in traces):
        gpu_note = "GPU traces: gpu idle = step minus the union of all kernels (host-bound time). "
    table = {
        "data wait": mean("data_wait_s"),
        "communication": comm,
        "launch/dispatch overhead": mean("overhead_s"),
        "compute": max(0.0, busy - comm),
    }
    return {
        "run_dir": run_dir, "steps": n, "step_s": step, "table": table,
        "percent": {k: 100.0 * v / step for k, v in table.items()},
        "samples_per_s": sum(r["samples"] for r in use) / sum(r["step_s"] for r in use),
        "world": use[-1].get("world", 1), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
        "traces": [{"path": t["path"], "kind": t["kind"], "comm_events": t["comm_events"],
                    "comm_event_count": t["comm_event_count"],
                    "comm_s_per_step": [s["comm_s"] for s in t["steps"]],
                    "step_s": [s["step_s"] for s in t["steps"]],
                    **({"gpu_idle_s": [s["gpu_idle_s"] for s in t["steps"]]} if t["kind"] == "gpu" else {})}
                   for t in traces],
        "footnote": FOOTNOTE.format(comm_src=comm_src, gpu_note=gpu_note, first=use[0]["step"],
                                    last=use[-1]["step"], skip=skip),
    }


def format_table(b: dict) -> str:
    lines = [f"step-time breakdown: {b['run_dir']}  ({b['steps']} steps, {b['world']} ranks, "
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
    lines.append("")
    lines.append("* " + b["footnote"])
    return "\n".join(lines)


def write_chart(b: dict, run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    series = {"data wait": [r["data_wait_s"] for r in rows], "communication": [r["comm_s"] or 0.0 for r in rows],
              "launch/dispatch overhead": [r["overhead_s"] for r in rows],
              "compute": [max(0.0, r["forward_s"] + r["backward_s"] + r["optimizer_s"] - (r["comm_s"] or 0.0))
                          for r in rows]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 3]})
    left = 0.0
    for k, v in b["table"].items():
        ax1.barh([0], [v * 1e3], left=left, label=f"{k} {b['percent'][k]:.0f}%")
        left += v * 1e3
    ax1.set_yticks([])
    ax1.set_xlabel("ms per step (mean)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    bottom = [0.0] * len(rows)
    for k, v in series.items():
        ax2.bar(steps, [x * 1e3 for x in v], bottom=bottom, label=k)
        bottom = [a + x * 1e3 for a, x in zip(bottom, v)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("ms")
    ax2.set_title("per-step breakdown")
    fig.tight_layout()
    path = os.path.join(run_dir, "profile.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_html(b: dict, run_dir: str) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4f}</td><td>{b['percent'][k]:.1f}%</td></tr>"
                   for k, v in b["table"].items())
    doc = (f"<html><body><h3>{html.escape(b['run_dir'])}</h3><table border=1><tr><th>phase</th><th>s</th>"
           f"<th>% of step</th></tr>{rows}</table><p>{html.escape(b['footnote'])}</p>"
           f"<img src='profile.png'></body></html>")
    path = os.path.join(run_dir, "profile.html")
    with open(path, "w") as f:
        f.write(doc)
    return path


def to_json(b: dict) -> str:
    return json.dumps(b, indent=2, sort_keys=True)
