"""Statistics, timed passes and the rendered table/plot, on known inputs."""

from __future__ import annotations

import json

import pytest

from loongforge.benchmarks.harness.config import BenchConfig
from loongforge.benchmarks.harness.measure import Stat, batch_size_of, endless, ratio, time_pass
from loongforge.benchmarks.harness.report import markdown_table, plot, result_path, write_json
from loongforge.benchmarks.harness.rows import Row
from loongforge.shared.errors import ConfigError


def test_stat_and_ratio_spread():
    a, b = Stat.of([10, 30, 20]), Stat.of([2, 4, 5])
    assert (a.median, a.min, a.max) == (20, 10, 30)
    r = ratio(a, b)
    assert r.median == 5 and r.min == 10 / 5 and r.max == 30 / 2
    assert ratio(a, Stat.of([0])).median == float("inf")
    with pytest.raises(ValueError):
        Stat.of([])


def test_time_pass_excludes_warmup_and_counts_samples():
    import numpy as np

    batches = iter([{"x": np.zeros((4, 2))}] * 2 + [{"x": np.zeros((3, 2))}] * 5)
    seen = []
    t = time_pass(batches, warmup=2, timed=5, on_batch=seen.append)
    assert t.samples == 15 and len(t.wait_s) == 5 and len(seen) == 5
    assert t.samples_per_s > 0


def test_time_pass_waits_for_ready_and_skips_batches_decoded_meanwhile():
    import numpy as np

    pulled, calls = [], []

    def batches():
        for i in range(20):
            pulled.append(i)
            yield {"x": np.zeros((i + 1, 1))}

    def ready():  # a loader whose workers came up while 3 batches were decoded ahead
        calls.append(len(pulled))
        return 3

    seen = []
    t = time_pass(batches(), warmup=1, timed=4, on_batch=lambda b: seen.append(len(b["x"])), ready=ready)
    assert calls == [1]  # after the warm-up, before any timed batch
    assert t.settle_batches == 3 and seen == [5, 6, 7, 8] and t.samples == 26


def test_endless_restarts_epochs_and_refuses_an_empty_loader():
    epochs = iter([[1, 2], [3]])
    it = endless(lambda: next(epochs))
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(RuntimeError, match="no batch"):
        next(endless(lambda: []))


def test_batch_size_of_nested_and_lists():
    import torch

    assert batch_size_of({"frames": {"a": torch.zeros(5, 1)}, "state": torch.zeros(5, 2)}) == 5
    assert batch_size_of({"task": ["a", "b"]}) == 2


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="bench.repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(ConfigError, match="bench.workers"):
        BenchConfig(workers=())
    q = BenchConfig.quick_preset()
    assert q.quick and q.gop >= 100 and q.with_overrides(repeats=None).repeats == q.repeats
    # P1 sweeps the GOP: LeRobot's default 2, a mid value and the long one the shards come from.
    assert BenchConfig().gops == (2, 20, 250) and BenchConfig().gop == 250 and q.gops == (2, 20, 100)
    with pytest.raises(ConfigError, match="bench.gops"):
        BenchConfig(gop=250, gops=(2, 20))


def _doc():
    ok = Row(id="P1/w0", title="Loader samples/s, 0 workers", unit="samples/s", params={"workers": 0},
             baseline=Stat.of([1.0, 2.0, 3.0]), ours=Stat.of([40.0, 50.0]), goal=">= 20x", goal_met=True)
    ok.ratio = ratio(ok.ours, ok.baseline)
    share = Row(id="P3/share", title="Data-wait share", unit="share", baseline=Stat.of([0.6]),
                ours=Stat.of([0.02]), goal="< 5%", goal_met=True)
    missing = Row.unavailable("P4", "Cold start", "cache daemon missing")
    rgb = Row(id="P1/g2/w0", title="float RGB", unit="samples/s", params={"workers": 0, "gop": 2},
              baseline=Stat.of([1.0]), ours=Stat.of([3.0]), ratio=Stat.of([3.0]), goal="reported (CPU-only path)")
    return {"started": "2026-01-01T00:00:00+00:00", "config": BenchConfig().to_dict(),
            "machine": {"cpu_model": "Test CPU", "cores_usable": 2, "host": "h"},
            "rows": [r.to_dict() for r in (ok, share, missing, rgb)],
            "components": [{"id": "C-cache/hit", "title": "hit rate", "status": "ok", "raw": {"lru": 0.5}},
                           {"id": "C-preprocess", "title": "x", "status": "not available: not written", "raw": {}}]}


def test_markdown_table_shows_every_row_its_spread_and_unavailability():
    text = markdown_table(_doc())
    assert "| P1/w0 |" in text and "2.00 [1.00–3.00] samples/s" in text and "45.0 [40.0–50.0] samples/s" in text and "22.5x [13.3–50.0]" in text
    assert "60.0%" in text and "2.0%" in text
    assert "not available: cache daemon missing" in text
    assert "lru=0.500" in text and "not available: not written" in text
    assert "| reported (CPU-only path) |" in text  # a figure beside the goals is not judged


def test_plot_and_json_are_written(tmp_path):
    import datetime as dt

    doc = _doc()
    path = result_path(tmp_path, dt.datetime(2026, 1, 2), "my host/1")
    assert path.name == "2026-01-02-my-host-1.json"
    png = plot(doc, path.with_suffix(".png"))
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_json(path, doc)
    assert json.loads(path.read_text())["rows"][0]["id"] == "P1/w0"


def test_workdir_with_foreign_files_is_never_wiped(tmp_path):
    from loongforge.benchmarks.harness.run import _claim_workdir

    mine = tmp_path / "bench"
    _claim_workdir(mine)
    (mine / "old-shards").mkdir()
    _claim_workdir(mine)  # an earlier bench workdir: wiped and re-marked
    assert not (mine / "old-shards").exists()
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(ConfigError, match="not made by"):
        _claim_workdir(foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"


def _nv12_row(busy: float) -> Row:
    r = Row(id="P1/g2/w2-nv12", title="t", unit="samples/s", params={"gop": 2, "workers": 2, "cores": 2,
                                                                      "baseline_decoded_frames_per_window": 4.0},
            baseline=Stat.of([100.0]), ours=Stat.of([1000.0]), ratio=Stat.of([10.0]), goal=">= 20x", goal_met=False,
            extra={"ours_busy_cores": Stat.of([busy]), "baseline_busy_cores": Stat.of([2.0]),
                   "ratio_per_cpu_s": Stat.of([12.0]), "baseline_samples_per_cpu_s": Stat.of([50.0]),
                   "ours_samples_per_cpu_s": Stat.of([600.0])})
    return r


def test_a_missed_p1_goal_names_what_bounded_loongforge():
    from types import SimpleNamespace

    from loongforge.benchmarks.loader.p1_rows import _explain, goal_for

    assert (goal_for(2), goal_for(20), goal_for(250)) == (20.0, 20.0, 50.0)
    ds = SimpleNamespace(frames_per_sample=4, slots=("a", "b"))
    prof = {"frames_per_s": 8000.0, "stage_share": {"zstd decompress": 0.7, "xxh3 check": 0.2, "other": 0.1}}
    ctx = SimpleNamespace(measured={"fill_profile": prof}, prep=SimpleNamespace(info=ds))
    waiting = _nv12_row(busy=0.5)
    _explain(ctx, waiting)  # half a core busy of 2 pinned: it waited, whatever its body costs
    assert "not CPU-bound" in waiting.notes[0] and "4.0 frames per window" in waiting.notes[0]
    bound = _nv12_row(busy=1.9)
    _explain(ctx, bound)  # cores busy: the worker body's profiled rate and stages are the bottleneck
    assert "CPU-bound" in bound.notes[0] and "1,000 samples/s on one core" in bound.notes[0]
    assert "zstd decompress 70%" in bound.notes[0] and bound.extra["worker_body_samples_per_s"] == 1000.0
