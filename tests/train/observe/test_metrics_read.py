"""read_metrics names every line it skips: a torn last line (a crash mid-write) and a corrupt
line in the middle each get a WARNING with the file and line number; the first line still fails."""

import json
import logging

import pytest

from loongforge.train.observe.metrics import METRICS_FILE, METRICS_VERSION, read_metrics


def _row(step):
    return json.dumps({"v": METRICS_VERSION, "step": step, "loss": 1.0}) + "\n"


def test_skipped_lines_are_warned_with_their_place(tmp_path, caplog):
    path = tmp_path / METRICS_FILE
    path.write_text(_row(0) + "{not json\n" + _row(1) + '{"v": 1, "st')
    with caplog.at_level(logging.WARNING, logger="loongforge.train.observe.metrics"):
        rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert f"{path}:2: not a JSON row" in said[0] and "corrupt" in said[0]
    assert f"{path}:4: torn last line" in said[1]


def test_a_bad_first_line_is_not_a_metrics_file(tmp_path):
    (tmp_path / METRICS_FILE).write_text("garbage\n" + _row(0))
    with pytest.raises(ValueError):
        read_metrics(str(tmp_path))
