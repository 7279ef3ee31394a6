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
