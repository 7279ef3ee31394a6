"""benchmarks/micro/order_scale.py at a small size: both orders agree and the row is complete."""

import json

from loongforge.benchmarks.cli import main as bench


def test_order_scale_small(tmp_path, capsys):
    assert bench(["order-scale", "--samples", "3e5", "--walk", "3e5", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("order-scale-*.json")).read_text())
    lazy, full = doc["rows"]
    assert (lazy["mode"], full["mode"]) == ("lazy", "full") and lazy["same"] is True
    per_rank = 3 * 10**5 // 1024 * 1024 // 8  # whole global batches, an 8th each
    assert lazy["walk_samples"] == per_rank
    assert "| 300,000 | lazy |" in capsys.readouterr().out
