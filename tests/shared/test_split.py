import numpy as np
import pytest

from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.errors import ConfigError
from loongforge.shared.split import choose_val_episodes, parse_val_spec
from loongforge.shared.synthetic import make_synthetic_root


def test_specs():
    assert parse_val_spec("") is None
    assert parse_val_spec("10%") == pytest.approx(0.1)
    assert parse_val_spec("7, 3,3") == (3, 7)
    for bad in ("0%", "100%", "x%", "a,b", "-1"):
        with pytest.raises(ConfigError, match="val_episodes"):
            parse_val_spec(bad)


def test_choose_is_deterministic_and_leaves_training_episodes():
    eps = list(range(40))
    a = choose_val_episodes("10%", eps)
    assert a == choose_val_episodes("10%", eps) and len(a) == 4 and set(a) <= set(eps)
    assert choose_val_episodes("3,7", eps) == (3, 7)
    assert len(choose_val_episodes("99%", [0, 1, 2])) == 2  # never every episode
    with pytest.raises(ConfigError, match="not in the dataset"):
        choose_val_episodes("41", eps)
    with pytest.raises(ConfigError, match="cannot be split"):
        choose_val_episodes("50%", [4])


def test_split_round_trips_through_the_index_and_filters_the_order(tmp_path):
    from loongforge.train.data.order import EpochOrder
    from loongforge.train.data.samples import SampleTable

    make_synthetic_root(str(tmp_path / "a"), lengths=(4, 4, 4))
    assert b"split" not in (tmp_path / "a" / "index.json").read_bytes()  # unsplit indexes keep their bytes
    assert open_root(str(tmp_path / "a")).val_episodes == frozenset()
    make_synthetic_root(str(tmp_path / "b"), lengths=(4, 4, 4), val_episodes=(1,))
    ds = open_root(str(tmp_path / "b"))
    assert ds.val_episodes == {1} and load_shard_index(str(tmp_path / "b")).val_episodes == (1,)
    assert ds.val_mask.tolist() == [False, True, False] and [ds.split(e) for e in range(3)] == ["train", "val", "train"]
    table = SampleTable(np.asarray(ds.episode_lengths))
    keep = ~ds.val_mask
    seq = EpochOrder(table, 4, 0, 0, run=2, window=4, train_episodes=keep).ids(0, 8)
    full = EpochOrder(table, 4, 0, 0, run=2, window=4).ids(0, 12)
    assert sorted(seq.tolist()) == [0, 1, 2, 3, 8, 9, 10, 11]  # episode 1 (ids 4..7) left out
    assert set(full.tolist()) == set(range(12))
