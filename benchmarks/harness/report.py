"""What a bench run leaves behind: machine info, the result JSON, the markdown
table (stdout and README) and the PNG plot, all generated from measured rows."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

from loongforge.shared.storage import write_bytes_atomic

RESULT_VERSION = 1
# NOTE: results, figures and generated data live outside the package: the checkout's top-level
# results/ when running from a source checkout (make bench), else ./results of the working directory.
SOURCE_CHECKOUT = Path(__file__).resolve().parents[2]
RESULTS_DIR = (SOURCE_CHECKOUT / "results" if (SOURCE_CHECKOUT / "pyproject.toml").is_file()
               else Path.cwd() / "results")
LIBRARIES = ("loongforge", "torch", "av", "numpy", "zstandard", "pyarrow", "apache-beam", "redis", "torchcodec",
             "deepspeed")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_info() -> dict:
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {"host": socket.gethostname(), "cpu_model": _cpu_model(), "cores_logical": os.cpu_count(),
            "cores_usable": usable, "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "libraries": versions, "git_commit": _git_commit(),
            "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "gpu": "none measured (CPU-only benchmark)"}


def result_path(out_dir: Path, when: _dt.datetime, host: str) -> Path:
    safe_host = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:40] or "host"
    return out_dir / f"{when:%Y-%m-%d}-{safe_host}.json"


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(str(path), (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode())


def write_timestamped(out_dir: str, prefix: str, doc: dict) -> str:
    """<out_dir>/<prefix>-<local time>-<host>.json (a new file per run, so runs never
    overwrite each other); prints and returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{platform.node()}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"results: {path}")
    return path


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01 or a == 0:
        return f"{v:#.3g}"
    return f"{v:.2e}"


def fmt_stat(s: dict | None, unit: str = "") -> str:
    if not s:
        return "-"
    share = unit == "share"
    f = (lambda x: f"{100 * x:.1f}%") if share else _fmt
    spread = "" if s["min"] == s["max"] else f" [{f(s['min'])}–{f(s['max'])}]"
    tail = "" if share or not unit else f" {unit}"
    return f"{f(s['median'])}{spread}{tail}"


def fmt_ratio(s: dict | None) -> str:
    if not s:
        return "-"
    spread = "" if s["min"] == s["max"] else f" [{_fmt(s['min'])}–{_fmt(s['max'])}]"
    return f"{_fmt(s['median'])}x{spread}"


def _goal(row: dict) -> str:
    if not row.get("goal"):
        return ""
    met = row.get("goal_met")
    if met is None:  # a figure reported beside the goals, not judged
        return row["goal"]
    return f"{row['goal']}: " + ("met" if met else "MISSED")


def markdown_table(doc: dict) -> str:
    lines = ["| Row | What | Baseline | LoongForge | Ratio | Goal |", "|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['id']} | {row['title']} | {row['status']} | | | |")
            continue
        ratio = fmt_ratio(row["ratio"]) + (f" ({row['ratio_note']})" if row["ratio"] else "")
        lines.append(f"| {row['id']} | {row['title']} | {fmt_stat(row['baseline'], row['unit'])} | "
                     f"{fmt_stat(row['ours'], row['unit'])} | {ratio} | {_goal(row)} |")
    for row in doc.get("components", []):
        if row["status"] != "ok":
            lines.append(f"| {row['id']} | {row['title']} | {row['status']} | | | |")
            continue
        # Numbers and short labels only; the full dict (parameters too) is in the JSON.
        raw = {k: v for k, v in row["raw"].items() if k not in ("id", "name", "title", "params", "status")}
        body = ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}" for k, v in raw.items()
                         if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) <= 40))
        lines.append(f"| {row['id']} | {row['title']} | {body} | | | |")
    notes = [f"- {row['id']}: {n}" for row in doc["rows"] for n in row.get("notes", [])]
    m = doc["machine"]
    head = (f"LoongForge bench ({'quick' if doc['config']['quick'] else 'full'}), {doc['started']}, "
            f"{m['cpu_model']}, {m['cores_usable']} usable cores; median [min–max] of "
            f"{doc['config']['repeats']} repeat(s)")
    return "\n".join([head, "", *lines, *([""] + notes if notes else [])])


def plot(doc: dict, path: Path) -> Path | None:
    """P1 samples/s per GOP (log scale) and P3's data-wait share, baselines vs LoongForge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # P1 at the most workers, one group per GOP: both baselines, LoongForge RGB and NV12 out.
    cells = {}
    for r in doc["rows"]:
        if r["id"].startswith("P1/g") and r["status"] == "ok":
            cells.setdefault(r["params"]["gop"], {}).setdefault(r["params"]["workers"], {})[r["id"].split("/")[-1]] = r
    p3 = next((r for r in doc["rows"] if r["id"] == "P3/share" and r["status"] == "ok"), None)
    if not cells and p3 is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    if cells:
        gops = sorted(cells)
        w = max(max(c) for c in cells.values())
        tag = f"w{w}"
        series = [("baseline", tag, "PyAV on the fly"), ("baseline", tag + "-threaded", "PyAV threaded"),
                  ("ours", tag, "LoongForge, RGB out"), ("ours", tag + "-nv12", "LoongForge, NV12 out")]
        width = 0.8 / len(series)
        for i, (key, rid, label) in enumerate(series):
            rs = [cells[g].get(w, {}).get(rid) for g in gops]
            if any(r is None for r in rs):
                continue
            med = [r[key]["median"] for r in rs]
            err = [[m - r[key]["min"] for m, r in zip(med, rs)], [r[key]["max"] - m for m, r in zip(med, rs)]]
            ax1.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(gops))], med, width, yerr=err,
                    label=label, capsize=3)
        ax1.set_xticks(list(range(len(gops))), [f"GOP {g}" for g in gops])
        ax1.set_yscale("log")
        ax1.set_ylabel("samples/s (log)")
        ax1.set_title(f"P1 loader throughput, {w} workers, equal cores")
        ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small")
    if p3 is not None:
        vals = [p3["baseline"]["median"] * 100, p3["ours"]["median"] * 100]
        bars = ax2.bar(["baseline", "LoongForge"], vals, color=["tab:blue", "tab:orange"])
        ax2.bar_label(bars, labels=[f"{v:.1f}%" for v in vals])
        ax2.axhline(5, color="gray", linestyle="--", label="goal: 5%")
        ax2.set_ylabel("data-wait share of step time (%)")
        ax2.set_title("P3 data-bound training (tiny model)")
        ax2.legend()
    fig.suptitle(f"{doc['machine']['cpu_model']} ({doc['machine']['cores_usable']} cores), {doc['started']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
