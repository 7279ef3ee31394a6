"""profile.png of `loongforge profile RUN_DIR`: the mean breakdown, the per-step breakdown and the
loss / validation curve.

The per-step panel is drawn as stacked areas of per-bin means (at most MAX_BINS bins): thousands of
one-pixel bars alias into a moire. Its y-axis spans the steady state (a high percentile of the
non-warm-up steps), not the first step of a launch, which the table excludes too and which would
otherwise squash the steady steps into the bottom few percent; steps above the axis are counted in
the title."""

from __future__ import annotations

import os

import numpy as np

from loongforge.train.observe.metrics import read_metrics

MAX_BINS = 200
PHASES = ("data wait", "communication", "launch/dispatch overhead", "compute")


def _phases(r: dict) -> dict[str, float]:
    comm = r.get("comm_s") or 0.0
    return {"data wait": r["data_wait_s"], "communication": comm, "launch/dispatch overhead": r["overhead_s"],
            "compute": max(0.0, r["forward_s"] + r["backward_s"] + r["optimizer_s"] - comm)}


def _binned(x: np.ndarray, y: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of y over `bins` consecutive groups of x (x itself when there are fewer points)."""
    if len(x) <= bins:
        return x, y
    groups = np.array_split(np.arange(len(x)), bins)
    return np.array([x[g].mean() for g in groups]), np.array([y[g].mean() for g in groups])


def chart_series(rows: list[dict], max_bins: int = MAX_BINS) -> dict:
    """What the chart draws, in ms: per-bin step numbers and phase means, the y limit of the steady
    state, the number of steps above it, the loss (per bin) and the validation points."""
    warm = {rows[0]["step"]} | {r["step"] for r in rows if r.get("warmup")}
    steps = np.array([r["step"] for r in rows], float)
    phases = {k: np.array([_phases(r)[k] * 1e3 for r in rows]) for k in PHASES}
    total = sum(phases.values())
    steady = np.array([r["step"] not in warm for r in rows]) if len(rows) > len(warm) else np.ones(len(rows), bool)
    ylim = float(np.percentile(total[steady], 99)) * 1.25 or 1.0
    x, _ = _binned(steps, total, max_bins)
    binned = {k: _binned(steps, v, max_bins)[1] for k, v in phases.items()}
    lx, loss = _binned(steps, np.array([r["loss"] for r in rows]), max_bins)
    val = {k: [(r["step"], r[k]) for r in rows if k in r] for k in ("val_flow_loss", "val_action_mse")}
    return {"x": x, "phases": binned, "ylim": ylim, "clipped": int((total > ylim).sum()),
            "loss_x": lx, "loss": loss, "val": {k: v for k, v in val.items() if v}}


def write_chart(b: dict, run_dir: str) -> str:
    import matplotlib  # heavy, only for the chart

    matplotlib.use("Agg")  # headless: no display on training nodes
    import matplotlib.pyplot as plt

    s = chart_series(read_metrics(run_dir))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 3, 2]})
    left = 0.0
    for k, v in b["table"].items():
        ax1.barh([0], [v * 1e3], left=left, label=f"{k} {b['percent'][k]:.0f}%")
        left += v * 1e3
    ax1.set_yticks([])
    ax1.set_xlabel("ms per step (mean, steady state)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax2.stackplot(s["x"], *s["phases"].values(), labels=list(s["phases"]), step="mid")
    ax2.set_ylim(0, s["ylim"])
    ax2.set_xlabel("step")
    ax2.set_ylabel("ms")
    clipped = f"; {s['clipped']} step(s) above the axis (warm-up, spikes)" if s["clipped"] else ""
    ax2.set_title(f"per-step breakdown (bin means){clipped}", fontsize=9)
    ax3.plot(s["loss_x"], s["loss"], label="train loss", lw=1)
    for k, pts in s["val"].items():
        ax3.plot(*zip(*pts), "o-", ms=3, label=k)
    ax3.set_xlabel("step")
    ax3.set_title("loss", fontsize=9)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(run_dir, "profile.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
