"""`loongforge profile` on a run resumed with another rank count."""

import json

import pytest

from loongforge.train.observe import breakdown as report


def _row(step, world, step_s, warmup=None):
    r = {"v": 1, "step": step, "step_s": step_s, "data_wait_s": 0.0, "forward_s": step_s / 2,
         "backward_s": step_s / 2, "optimizer_s": 0.0, "comm_s": 0.0, "compute_s": step_s, "overhead_s": 0.0,
         "loss": 1.0, "samples": 8, "world": world}
    if warmup is not None:
        r["warmup"] = warmup
    return r


def _write(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return report.breakdown(str(tmp_path))


@pytest.mark.parametrize("flagged", [True, False])  # False: metrics written before the warm-up flag existed
def test_resume_with_another_world_size_splits_and_drops_each_warmup(tmp_path, flagged):
    # 2 ranks for steps 0..4 (step 0 slow: warm-up), resumed on 4 ranks for 5..9 (step 5 slow: warm-up)
    rows = [_row(s, 2, 9.0 if s == 0 else 1.0, (s == 0) if flagged else None) for s in range(5)]
    rows += [_row(s, 4, 9.0 if s == 5 else 0.5, (s == 5) if flagged else None) for s in range(5, 10)]
    b = _write(tmp_path, rows)
    two, four = b["segments"]
    assert (two["world"], two["first_step"], two["last_step"], two["steps"]) == (2, 0, 4, 4)
    assert (four["world"], four["first_step"], four["last_step"], four["steps"]) == (4, 5, 9, 4)
    assert two["step_s"] == pytest.approx(1.0) and four["step_s"] == pytest.approx(0.5)  # no warm-up, no mixing
    assert two["samples_per_s"] == pytest.approx(8.0) and four["samples_per_s"] == pytest.approx(16.0)
    assert b["world"] == 4 and b["step_s"] == pytest.approx(0.5)  # top level: the latest segment
    text = report.format_table(b)
    assert "steps 0..4, 4 steps, 2 ranks" in text and "steps 5..9, 4 steps, 4 ranks" in text


def test_resume_with_the_same_world_size_drops_the_first_step_after_resume(tmp_path):
    rows = [_row(s, 2, 9.0 if s in (0, 6) else 1.0, s in (0, 6)) for s in range(10)]
    b = _write(tmp_path, rows)
    assert len(b["segments"]) == 1 and b["warmup_steps"] == [0, 6] and b["steps"] == 8
    assert b["step_s"] == pytest.approx(1.0)
