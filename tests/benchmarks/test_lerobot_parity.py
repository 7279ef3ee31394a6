"""The parity check against the real lerobot (benchmarks/loader/lerobot_parity.py): its comparison,
fed what lerobot 0.6.1 itself returned for the v3.0 fixture (../shared/fixtures/lerobot_v3), finds
every item equal; the venv-side scripts compile; a missing venv is one clear line. The run
against a live lerobot venv is `loongforge bench lerobot-parity` (not in make test: lerobot is
not a project dependency)."""

from __future__ import annotations

import json
import py_compile

import numpy as np
import pytest

from loongforge.benchmarks.loader.lerobot_parity import SCRIPTS, clamped_rows, compare, table
from loongforge.cli import main
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.train.data.lerobot import LeRobotDataset
from tests.outside import copy_fixture, fixture_dir


def test_the_comparison_finds_lerobots_own_items_equal(tmp_path):
    src = copy_fixture("lerobot_v3/video", tmp_path / "video")
    run_job(PreprocessConfig(input=str(src), output=str(tmp_path / "out"), workers=1),
            ["--direct_running_mode=in_memory", "--direct_num_workers=1"])
    spec = json.loads((fixture_dir("lerobot_v3") / "video_items.json").read_text())
    z = np.load(fixture_dir("lerobot_v3") / "video_items.npz")
    theirs = {int(i): {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}/")} for i in z["indices"]}
    deltas = spec["delta_timestamps"]
    ours = LeRobotDataset(str(tmp_path / "out"), delta_timestamps=deltas)
    exact = LeRobotDataset(str(tmp_path / "out"), delta_timestamps=deltas, color="pyav")
    clamped = clamped_rows(src)
    assert clamped == {"observation.images.front": set(), "observation.images.wrist": set()}
    r = compare(ours, exact, theirs, deltas, clamped)
    n = len(theirs)
    assert (r["values_equal"], r["key_sets_equal"], r["images_bit_exact"], r["lerobot_raised"]) == (n, n, n, 0)
    assert r["value_mismatches"] == {} and r["images_unexplained"] == 0 and 0 < r["image_max_255"] < 3.001
    r.update(dataset="fixture video", deltas="fixture's", video=True)
    assert f"| fixture video | fixture's | {n} | 0 (yes) | {n} / {n} | {n} / {n} | 0 | 3 / " in table([r])


def test_the_venv_scripts_compile_and_a_missing_venv_is_one_line(tmp_path, capsys):
    for name in ("dump_items.py", "time_loader.py"):
        py_compile.compile(str(SCRIPTS / name), cfile=str(tmp_path / f"{name}c"), doraise=True)
    assert (SCRIPTS / "setup.sh").read_text().count("lerobot[dataset]==0.6.1") == 1
    for bench in ("lerobot-parity", "lerobot-baseline"):
        assert main(["bench", bench, "--lerobot-venv", str(tmp_path / "nope")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "benchmarks/lerobot_venv/setup.sh" in err


def test_parity_compares_a_dataset_of_ones_own_and_makes_its_work_folder(tmp_path, capsys):
    """`--dataset ROOT` is what lerobot is asked about (the bench took no dataset path), and a --work
    folder that does not exist yet is made (it was a FileNotFoundError traceback). The venv here is a
    stand-in whose Python records the root it was given and fails, which the bench says in one line."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    asked = tmp_path / "asked"
    (venv / "bin" / "python").write_text(f"#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = --root ] && echo \"$2\" >> "
                                         f"{asked}; shift; done\necho 'no lerobot here' >&2\nexit 1\n")
    (venv / "bin" / "python").chmod(0o755)
    src = copy_fixture("lerobot_v3/video", tmp_path / "mine")
    work = tmp_path / "not" / "yet"
    rc = main(["bench", "lerobot-parity", "--lerobot-venv", str(venv), "--dataset", str(src), "--work", str(work)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no lerobot here" in err, err
    assert asked.read_text().split() == [str(src)] and work.is_dir()
    v21 = tmp_path / "v21" / "meta"
    v21.mkdir(parents=True)
    (v21 / "info.json").write_text('{"codebase_version": "v2.1"}')
    assert main(["bench", "lerobot-parity", "--lerobot-venv", str(venv), "--dataset", str(v21.parent)]) == 2
    assert "lerobot 0.6.1 reads only v3.0" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["lerobot-parity", "lerobot-baseline"])
def test_help_names_the_venv_option(bench, capsys):
    with pytest.raises(SystemExit):
        main(["bench", bench, "--help"])
    assert "--lerobot-venv" in capsys.readouterr().out
