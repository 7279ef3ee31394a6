"""`loongforge tune buckets` and the job launcher it shares with `loongforge bench scale`."""

from __future__ import annotations

import json

import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.tune import jobs
from loongforge.train.tune.buckets import sweep, table
from loongforge.train.tune.cli import parse_sizes


def test_plan_args():
    assert jobs.plan_args("dp") == ({"tp": 1, "sp": 1, "zero": 2, "compress": 0.0},
                                    ["--tp", "1", "--sp", "1", "--zero", "2"])
    plan, flags = jobs.plan_args("tp=2,sp=2,zero=3,compress=3")
    assert plan == {"tp": 2, "sp": 2, "zero": 3, "compress": 3.0}
    assert flags[-4:] == ["--grad-compression", "topk", "--compress-ratio", "3.0"]
    assert jobs.plan_name(plan) == "tp2-sp2-zero3-topk3"
    with pytest.raises(ConfigError, match="key=value"):
        jobs.plan_args("pp=2")
    with pytest.raises(ConfigError, match="--sizes"):
        parse_sizes("big")


def test_summarise_skips_warmup_and_sums_groups(tmp_path):
    rows = [{"step": 0, "warmup": True, "step_s": 9.0, "loss": 3.0,
             "comm_groups": {"dp": {"calls": 3, "payload_bytes": 10, "wire_bytes": 10, "seconds": 5.0}}}]
    for s, (step_s, a, b) in enumerate([(1.0, 0.1, 0.2), (2.0, 0.3, 0.1), (1.5, 0.2, 0.2)], start=1):
        rows.append({"step": s, "warmup": False, "step_s": step_s, "loss": 1.0 / s,
                     "comm_groups": {"dp": {"calls": 3, "payload_bytes": 10, "wire_bytes": 10, "seconds": a},
                                     "tp": {"calls": 8, "payload_bytes": 40, "wire_bytes": 40, "seconds": b}}})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    res = jobs.summarise(str(tmp_path), 2, ["--tp", "2"])
    assert res.steps == 3 and res.step_s == 1.5 and res.comm_s == pytest.approx(0.4)
    assert res.wire_bytes == 50 and res.groups["tp"]["calls"] == 8
    assert res.loss_last == pytest.approx(1 / 3)


@pytest.mark.slow
@pytest.mark.full
def test_bucket_sweep_real_launches(tmp_path):
    """Two real 2-rank jobs: the same bytes go out, in fewer collectives with the larger bucket."""
    doc = sweep(world=2, plan="dp", sizes=(20_000, 50_000_000), overlaps=(True,), recipe="tiny", steps=3,
                micro_batch=2, data=None, workdir=str(tmp_path), device="cpu")
    small, large = doc["rows"]
    assert small["wire_bytes"] == pytest.approx(large["wire_bytes"], rel=0.01)
    assert small["calls"] > large["calls"]
    assert "fastest" in table(doc) and doc["best"]["bucket_bytes"] in (20_000, 50_000_000)
