import dataclasses

import numpy as np
import pytest

from loongforge.shared.errors import ConfigError
from loongforge.shared.index import ShardIndex, load_index, save_index
from loongforge.shared.split import choose_val_episodes, parse_val_spec, sample_episodes, train_mask
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.order_v1 import epoch_sequence


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
    index = make_synthetic_root(str(tmp_path), shards=3, samples_per_shard=4)
    assert b"split" not in index.to_json()  # unsplit indexes keep their bytes
    assert train_mask(index) is None
    split = dataclasses.replace(index, val_episodes=(1,))
    save_index(split, str(tmp_path))
    again = load_index(str(tmp_path))
    assert again.val_episodes == (1,) and ShardIndex.from_json(again.to_json()) == again
    eps = sample_episodes(again)
    keep = train_mask(again)
    assert keep.tolist() == (eps != 1).tolist() and keep.sum() == 8
    seq = epoch_sequence([4, 4, 4], seed=0, epoch=0, window=3, keep=keep)
    full = epoch_sequence([4, 4, 4], seed=0, epoch=0, window=3)
    assert sorted(seq.tolist()) == np.flatnonzero(keep).tolist()
    assert seq.tolist() == [g for g in full.tolist() if keep[g]]  # same order, val samples left out
