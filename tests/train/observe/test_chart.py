"""profile.png: over 2,000 steps with a 1.6 s warm-up step and ~50 ms steady steps, the per-step panel
spans the steady state (the warm-up step is clipped and counted), draws bin means instead of 2,000
one-pixel bars, and a loss / validation curve sits beside it."""

from __future__ import annotations

import json
import os

import matplotlib.figure
import numpy as np

from loongforge.train.observe import breakdown
from loongforge.train.observe.chart import MAX_BINS, chart_series, write_chart

STEPS = 2000


def _rows() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for step in range(STEPS):
        warm = step == 0
        fwd = 1.5 if warm else 0.02 + 0.002 * rng.random()
        row = {"v": 1, "step": step, "loss": 2.0 / (1 + step / 200), "samples": 8, "warmup": warm, "world": 1,
               "data_wait_s": 0.005, "forward_s": fwd, "backward_s": 0.02, "optimizer_s": 0.003, "comm_s": 0.001,
               "overhead_s": 0.002}
        row["step_s"] = sum(row[k] for k in ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "overhead_s"))
        if step % 500 == 499:
            row.update(val_flow_loss=1.0 / (1 + step / 300), val_action_mse=0.5 / (1 + step / 300))
        rows.append(row)
    return rows


def test_chart_series_spans_the_steady_state_in_bins():
    s = chart_series(_rows())
    assert len(s["x"]) == MAX_BINS and all(len(v) == MAX_BINS for v in s["phases"].values())
    assert 52 < s["ylim"] < 80 and s["clipped"] == 1  # ~52 ms steps; the 1.6 s warm-up step is above the axis
    assert len(s["loss"]) == MAX_BINS and s["loss"][0] > s["loss"][-1]
    assert [step for step, _ in s["val"]["val_action_mse"]] == [499, 999, 1499, 1999]


def test_profile_png_has_steady_axis_no_bar_flood_and_a_loss_curve(tmp_path, monkeypatch):
    run = str(tmp_path)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows())
    figs = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figs.append(fig), real(fig, *a, **k)))
    path = write_chart(breakdown.breakdown(run), run)
    assert os.path.getsize(path) > 5000
    [fig] = figs
    per_step = next(ax for ax in fig.axes if "per-step" in ax.get_title())
    assert per_step.get_ylim()[1] < 100  # ms: the steady steps fill the panel
    assert len(per_step.patches) < 50  # areas, not 8,000 bar rectangles
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"train loss", "val_flow_loss", "val_action_mse"} <= labels
