import pytest

from loongforge.preprocess.config import PreprocessConfig
from loongforge.shared.errors import ConfigError
from loongforge.shared.index import load_index
from loongforge.shared.split import sample_episodes, train_mask


def test_val_episodes_are_written_into_the_index(sample_dataset, tmp_path, run_in_memory):
    out = str(tmp_path / "out")
    run_in_memory(sample_dataset, out, frames_per_sample=2, stride=4, action_horizon=4, val_episodes="1")
    index = load_index(out)
    assert index.val_episodes == (1,)
    eps = sample_episodes(index)
    assert set(eps[train_mask(index)].tolist()) == {0, 2} and (eps == 1).any()


def test_bad_val_spec_fails_before_any_work():
    with pytest.raises(ConfigError, match="val_episodes"):
        PreprocessConfig(input="in", output="out", val_episodes="150%")


def test_norm_stats_come_from_training_episodes_only(sample_dataset, tmp_path, run_in_memory):
    """The validation episodes must not leak into training through the normalisation."""
    import numpy as np
    import pyarrow.parquet as pq

    from loongforge.preprocess.discover import discover

    out = str(tmp_path / "out")
    run_in_memory(sample_dataset, out, frames_per_sample=2, stride=4, action_horizon=4, val_episodes="1")
    stats = load_index(out).dataset.stats
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
