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

    from loongforge.preprocess.discover import discover

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
