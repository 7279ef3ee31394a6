"""Tables and the PNG of `loongforge bench scale` (benchmarks/scale/run.py): measured rows, then the
projection, each labelled as what it is."""

from __future__ import annotations

from pathlib import Path


def tables(doc: dict) -> str:
    lines = [f"MEASURED ({doc['device']}, gloo, recipe {doc['recipe']}, {doc['micro_batch_per_replica']} samples "
             f"per replica per step, load avg {doc['load_avg']:.1f})",
             "| plan | ranks | step ms | comm ms | comm share | MB sent / rank / step | by group (MB) "
             "| model comm ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["measured"]:
        if r["status"] != "ok":
            lines.append(f"| {r['plan_name']} | {r['world']} | {r['status']} | | | | | |")
            continue
        by = ", ".join(f"{k} {v['wire_bytes'] / 1e6:.3f}" for k, v in sorted(r["groups"].items()))
        lines.append(f"| {r['plan_name']} | {r['world']} | {r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
                     f"{r['comm_share']:.1%} | {r['wire_bytes'] / 1e6:.3f} | {by} | {r['model_comm_s'] * 1e3:.1f} |")
    lf, pi = doc["link_fit"], doc["projection_inputs"]
    bw = f"{lf['bandwidth_mb_s']:.0f} MB/s" if lf["bandwidth_mb_s"] else "n/a"
    lines += ["", f"fitted link of this machine: alpha {lf['alpha_s'] * 1e6:.0f} us/call, bandwidth {bw}", "",
              f"PROJECTED (alpha-beta; recipe {pi['recipe']} in {pi.get('dtype_bytes', 2)}-byte elements, bytes "
              "scaled per plan (ZeRO: parameters one TP rank holds; TP/SP: dim x depth x tokens); compute "
              f"{pi['compute_s_per_step']:.2f} s/step; "
              f"NVLink {pi['hardware']['nvlink_gbps']:g} GB/s {pi['hardware']['nvlink_latency_us']:g} us, "
              f"IB {pi['hardware']['ib_gbps']:g} GB/s {pi['hardware']['ib_latency_us']:g} us, "
              f"{pi['hardware']['gpus_per_node']} GPUs/node; no overlap)",
              "| plan | GPUs | comm s | comm share | MB sent / GPU / step | links | flag |",
              "|---|---|---|---|---|---|---|"]
    for name, p in doc["plans"].items():
        for q in p["projection"]:
            links = ", ".join(f"{k}:{v['link']}" for k, v in sorted(q["groups"].items()) if v["group_size"] > 1)
            flag = "**> 30%: rethink the plan**" if q["over_30pct"] else ""
            lines.append(f"| {name} | {q['world']} | {q['comm_s']:.3f} | {q['comm_share']:.1%} | "
                         f"{q['wire_bytes'] / 1e6:.1f} | {links} | {flag} |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in doc["plans"]:
        rows = [r for r in doc["measured"] if r["plan_name"] == name and r["status"] == "ok"]
        xs = [r["world"] for r in rows]
        ax1.plot(xs, [r["step_s"] * 1e3 for r in rows], "o-", label=f"{name} step")
        ax1.plot(xs, [r["comm_s"] * 1e3 for r in rows], "x--", label=f"{name} comm")
        ax2.plot(xs, [r["comm_share"] * 100 for r in rows], "o-", label=f"{name} measured (gloo)")
        proj = doc["plans"][name]["projection"]
        ax2.plot([q["world"] for q in proj], [q["comm_share"] * 100 for q in proj], "s--",
                 label=f"{name} projected ({doc['projection_inputs']['recipe']}, GPUs)")
    ax1.set(xlabel="ranks", ylabel="ms per step", title=f"measured, {doc['device']} gloo, {doc['recipe']}")
    ax2.axhline(30, color="red", lw=0.8, ls=":")
    ax2.set(xscale="log", xlabel="ranks / GPUs", ylabel="comm share %", title="comm share: measured and projected")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
