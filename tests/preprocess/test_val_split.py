"""The validation split on the default format (2): the held-out episodes are in the index and
out of the normalisation stats. shared/test_split.py covers the split in the order."""

import numpy as np
import pytest

from loongforge.preprocess.config import PreprocessConfig
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import ConfigError


def test_val_episodes_are_written_into_the_index(sample_dataset, tmp_path, run_in_memory):
    out = str(tmp_path / "out")
    run_in_memory(sample_dataset, out, action_horizon=4, val_episodes="1")
    ds = open_root(out)
    assert ds.val_episodes == {1}
    assert [ds.split(e) for e in range(ds.num_episodes)] == ["train", "val", "train"]
    assert np.asarray(ds.val_mask).tolist() == [False, True, False]


def test_bad_val_spec_fails_before_any_work():
    with pytest.raises(ConfigError, match="val_episodes"):
        PreprocessConfig(input="in", output="out", val_episodes="150%")


def test_norm_stats_come_from_training_episodes_only(sample_dataset, tmp_path, run_in_memory):
    """The validation episodes must not leak into training through the normalisation."""
    import pyarrow.parquet as pq

    from loongforge.preprocess.stages.discover import discover

    out = str(tmp_path / "out")
    run_in_memory(sample_dataset, out, action_horizon=4, val_episodes="1")
    stats = open_root(out).stats
    _, episodes = discover(sample_dataset)
    tables = {e.index: pq.read_table(e.parquet) for e in episodes}
    rows = {col: {ep: np.array(t.column(col).to_pylist(), np.float64) for ep, t in tables.items()}
            for col in ("observation.state", "action")}
    for name, col in (("state", "observation.state"), ("action", "action")):
        train = np.concatenate([rows[col][0], rows[col][2]])
        everything = np.concatenate(list(rows[col].values()))
        assert stats[name]["count"] == len(train) < len(everything)
        np.testing.assert_allclose(stats[name]["mean"], train.mean(0), atol=1e-9)
        np.testing.assert_allclose(stats[name]["std"], train.std(0), atol=1e-9)
        np.testing.assert_array_equal(stats[name]["max"], train.max(0))


def test_val_episodes_naming_a_missing_episode_fails_before_any_transcoding(sample_dataset, tmp_path, capsys):
    """One line, exit 2 (a usage error), and nothing under OUT: the check runs against the episodes
    discovered, before Beam starts (it used to transcode everything, then fail inside Beam)."""
    from loongforge.cli import main

    out = tmp_path / "out"
    assert main(["preprocess", "--input", sample_dataset, "--output", str(out), "--val-episodes", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--val-episodes 7: episode 7 not in the dataset (it has 3: 0, 1, 2)" in err and "--val-count" in err
    assert not out.exists()


@pytest.mark.parametrize("flags, want", [({"val_count": 1}, 1), ({"val_fraction": 0.5}, 2), ({"val_count": 2}, 2)])
def test_val_count_and_fraction_pick_episodes(sample_dataset, tmp_path, run_in_memory, flags, want):
    out = str(tmp_path / "out")
    summary = run_in_memory(sample_dataset, out, action_horizon=4, **flags)
    ds = open_root(out)
    assert len(ds.val_episodes) == want and summary["val_episodes"] == sorted(ds.val_episodes)
    assert summary["train_episodes"] == 3 - want


def test_split_options_are_exclusive_and_counts_checked(sample_dataset, tmp_path, capsys):
    from loongforge.cli import main

    with pytest.raises(ConfigError, match="give one way"):
        PreprocessConfig(input="in", output="out", val_episodes="1", val_count=1)
    assert main(["preprocess", "--input", sample_dataset, "--output", str(tmp_path / "o"), "--val-count", "3"]) == 2
    assert "--val-count 3: the dataset has 3 episode(s)" in capsys.readouterr().err


def test_preprocess_and_inspect_show_the_held_out_episodes(sample_dataset, tmp_path, capsys):
    import json

    from loongforge.cli import main

    out = str(tmp_path / "out")
    beam = ["--", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    assert main(["preprocess", "--input", sample_dataset, "--output", out, "--val-episodes", "2", *beam]) == 0
    assert "split      1 validation episode(s) held out: 2; 2 train" in capsys.readouterr().out
    assert main(["inspect", out]) == 0
    assert "held out: 2;" in capsys.readouterr().out
    assert main(["inspect", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["val_episodes"] == [2] and report["train_episodes"] == 2
