"""The ablation's numbers: per-run summaries, the per-row table, goals, the stacked-bar plot.

Phases per step (train/observe/profiler.py; CPU: host clocks, gloo collectives are blocking so all
their time is exposed): data wait + exposed comm + launch/dispatch overhead + compute = step.
Each figure is a mean over the run's timed steps and over ranks; a row's phases come from its
median repeat, so the row's phases add up to its step time.
"""

from __future__ import annotations

import dataclasses
import statistics

PHASES = (("data_wait_s", "data wait"), ("comm_s", "exposed comm"), ("overhead_s", "launch/dispatch"),
          ("compute_s", "compute"))
DATA_WAIT_GOAL = 0.05  # the ladder's top row must wait on data < 5% of the step
SPEEDUP_GOAL = 2.3  # the seed: 4.15 s -> 1.78 s


def step_phases(rec: dict) -> dict:
    """One rank's step split into the four phases. Exposed comm (CPU): the host time of every
    collective in the step, DeepSpeed's and the parallel plan's own (TP, compression), from
    the per-group counter; DeepSpeed's timers alone miss the TP collectives. gloo collectives
    block the host, so on CPU all of it is exposed. CUDA: None here (host timers see launches,
    not kernels; the trace's timeline.py partition has exposed comm)."""
    busy = rec["forward_s"] + rec["backward_s"] + rec["optimizer_s"]
    groups = sum(g.get("seconds", 0.0) for g in (rec.get("comm_groups") or {}).values())
    comm = None if rec.get("comm_s") is None else min(busy, max(rec["comm_s"], groups))
    return {"step_s": rec["step_s"], "data_wait_s": rec["data_wait_s"], "comm_s": comm or 0.0,
            "overhead_s": rec["overhead_s"], "compute_s": busy - (comm or 0.0)}


def summarise_run(docs: list[dict]) -> dict:
    """One run (all ranks), mean over its timed steps. Per step the critical-path rank is used:
    the one that spent least time in collectives, i.e. arrived last; the others' extra collective
    time is waiting on it (a peer's slow data shows up as their comm). The mean over ranks is
    kept beside it (`rank_mean`)."""
    per_rank = [[step_phases(r) for r in d["records"]] for d in docs]
    n = min(len(p) for p in per_rank)
    critical = [min((p[i] for p in per_rank), key=lambda ph: ph["comm_s"]) for i in range(n)]
    keys = ("step_s", *(p for p, _ in PHASES))
    out = {k: statistics.fmean(c[k] for c in critical) for k in keys}
    out["rank_mean"] = {k: statistics.fmean(p[i][k] for p in per_rank for i in range(n)) for k in keys}
    out["phase_sum_error"] = abs(sum(out[p] for p, _ in PHASES) - out["step_s"]) / out["step_s"]
    saved = [d["saved_bytes"] for d in docs if d.get("saved_bytes") is not None]
    out["saved_bytes"] = max(saved) if saved else None
    out["losses"] = docs[0].get("losses")
    return out


def _row(spec, runs: list[dict], batch: int) -> dict:
    steps = sorted(r["step_s"] for r in runs)
    mid = sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]  # the median (lower) repeat
    samples = batch * spec.setting.batch_scale
    median = statistics.median(steps)
    # The median repeat's split, scaled to the median step (with an even repeat count the median is
    # a mean of two runs): the shares are that run's, and the phases add up to the step shown.
    scale = median / mid["step_s"]
    return {"step_s": {"median": median, "min": steps[0], "max": steps[-1], "values": steps},
            "phases_s": {p: mid[p] * scale for p, _ in PHASES},
            "phase_sum_error": max(r["phase_sum_error"] for r in runs),
            "repeats": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
            "data_wait_share": mid["data_wait_s"] / mid["step_s"], "saved_bytes": mid["saved_bytes"],
            "global_batch": samples, "samples_per_s": samples / statistics.median(steps)}


def build_doc(*, cfg: dict, plan: dict, rows, measured: dict, device: str) -> dict:
    out_rows = []
    for spec in rows:
        entry = {"id": spec.id, "block": spec.block, "label": spec.label, "note": spec.note,
                 "setting": dataclasses.asdict(spec.setting)}
        runs = measured["runs"].get(spec.id) or []
        if spec.skip is not None:
            entry["status"] = spec.skip
        elif spec.id in measured["errors"]:
            entry["status"] = measured["errors"][spec.id]
        elif not runs:
            entry["status"] = "pending"
        else:
            entry["status"] = "ok"
            entry.update(_row(spec, runs, cfg["batch"]))
        out_rows.append(entry)
    base = next((r for r in out_rows if r["id"] == "0" and r["status"] == "ok"), None)
    for r in out_rows:
        if base and r["status"] == "ok":
            r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
    return {"kind": "ablation", "version": 1, "config": cfg, "plan": plan, "device": device, "rows": out_rows,
            "goals": goals(out_rows)}


def goals(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    base = next((r for r in ok if r["id"] == "0"), None)
    top = next((r for r in reversed(ok) if r["block"] == "cumulative"), None)
    if base is None or top is None:
        return {"met": False, "why": "baseline or cumulative rows missing"}
    return {"baseline_data_wait_share": base["data_wait_share"], "top_row": top["id"],
            "top_data_wait_share": top["data_wait_share"], "top_speedup": top["speedup"],
            "data_wait_met": top["data_wait_share"] < DATA_WAIT_GOAL,
            "speedup_met": top["speedup"] >= SPEEDUP_GOAL,
            "met": top["data_wait_share"] < DATA_WAIT_GOAL and top["speedup"] >= SPEEDUP_GOAL}


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f}" if v >= 0.0995 else f"{v * 1e3:.1f}"


def markdown_table(doc: dict) -> str:
    head = ("| row | configuration | step ms median [min-max] x repeats | data wait | exposed comm | launch/dispatch | "
            "compute | activations saved (MiB) | samples/s | speed-up |")
    lines = [head, "|" + "---|" * 10]
    for r in doc["rows"]:
        label = r["label"] + (f" ({r['note']})" if r.get("note") else "")
        if r["status"] != "ok":
            lines.append(f"| {r['id']} | {label} | {r['status']} | | | | | | | |")
            continue
        st, ph = r["step_s"], r["phases_s"]
        cells = [f"{_ms(ph[p])} ({ph[p] / st['median']:.0%})" for p, _ in PHASES]
        mem = "-" if r["saved_bytes"] is None else f"{r['saved_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['id']} | {label} | {_ms(st['median'])} [{_ms(st['min'])}-{_ms(st['max'])}] "
                     f"x{len(st['values'])} | "
                     + " | ".join(cells) + f" | {mem} | {r['samples_per_s']:.1f} | {r.get('speedup', 0):.2f}x |")
    g = doc["goals"]
    if "top_speedup" in g:
        lines.append("")
        lines.append(f"data wait: {g['baseline_data_wait_share']:.0%} of the step at row 0 -> "
                     f"{g['top_data_wait_share']:.1%} at row {g['top_row']} (goal < 5%: "
                     f"{'met' if g['data_wait_met'] else 'missed'}); ladder speed-up {g['top_speedup']:.2f}x "
                     f"(goal >= {SPEEDUP_GOAL}x: {'met' if g['speedup_met'] else 'missed'})")
    return "\n".join(lines)


def plot(doc: dict, path) -> str | None:
    """One stacked bar per row (ms per step by phase); rows without a number are labelled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.5))
    colors = ("#d62728", "#1f77b4", "#ff7f0e", "#2ca02c")
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for (key, name), color in zip(PHASES, colors):
        vals = [r["phases_s"][key] * 1e3 if r["status"] == "ok" else 0.0 for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    top = max(bottom) if any(bottom) else 1.0
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            ax.text(i, top * 0.02, r["status"].split(" (")[0], rotation=90, ha="center", va="bottom", fontsize=7)
        elif "speedup" in r:
            ax.text(i, bottom[i], f"{r['speedup']:.1f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [r["id"] for r in rows])
    ax.set_ylabel("ms per step")
    cfg = doc["config"]
    ax.set_title(f"ablation: {cfg['recipe']} recipe, {cfg['ranks']} ranks, {doc['device']} "
                 "(C = cumulative, A = alone on row 0)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
