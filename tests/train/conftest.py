"""Fixtures of the trainer tests: synthetic shard roots and a helper that runs
a real multi-process launch (helpers in train_launch.py)."""

from __future__ import annotations

import pytest

@pytest.fixture(scope="session")
def train_root(tmp_path_factory):
    """4 shards x 16 samples, 2 cameras, 16x16 frames, 2 frames per window."""
    from loongforge.shared.synthetic import make_synthetic_root

    root = tmp_path_factory.mktemp("train_root")
    index = make_synthetic_root(str(root), shards=4, samples_per_shard=16)
    return str(root), index


@pytest.fixture(scope="session")
def variable_root(tmp_path_factory):
    """Variable frame counts (3 or 2 per window) for length bucketing."""
    from loongforge.shared.synthetic import make_synthetic_root

    root = tmp_path_factory.mktemp("variable_root")
    index = make_synthetic_root(str(root), shards=3, samples_per_shard=8, frames=3, variable_frames=True)
    return str(root), index
