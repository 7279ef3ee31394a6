"""A dataset whose meta/ files are damaged: one line naming the file, exit 2, nothing written."""

from __future__ import annotations

import pytest

from loongforge.cli import main
from loongforge.preprocess.samples.dataset import generate_dataset


@pytest.fixture
def dataset(tmp_path):
    return generate_dataset(tmp_path / "ds", episodes=1, frames=(4, 4), cameras=("front",))


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[: len(raw) // 2], "meta/info.json: not valid JSON"),  # half-truncated
    (lambda raw: b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "meta/info.json: not UTF-8 text"),  # binary
    (lambda raw: b"[1, 2]", "meta/info.json: a JSON object was expected"),
])
def test_damaged_info_json_is_one_line_naming_the_file(dataset, tmp_path, capsys, damage, message):
    info = dataset / "meta" / "info.json"
    info.write_bytes(damage(info.read_bytes()))
    out = tmp_path / "out"
    assert main(["preprocess", "--input", str(dataset), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_damaged_tasks_jsonl_names_the_file_and_line(dataset, tmp_path, capsys):
    (dataset / "meta" / "tasks.jsonl").write_bytes(b'{"task_index": 0, "task": "a"}\n{"task_index": 1, "ta\n')
    assert main(["preprocess", "--input", str(dataset), "--output", str(tmp_path / "out")]) == 2
    assert "meta/tasks.jsonl:2: not JSON" in capsys.readouterr().err
