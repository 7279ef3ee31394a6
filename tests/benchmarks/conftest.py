"""Fixtures of the benchmark tests: a small real LeRobot dataset (H.264 via PyAV)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def lerobot_root(tmp_path_factory):
    """2 episodes x 150-160 frames, 2 cameras, 32x32, GOP 100 (keyframes at 0 and 100)."""
    from loongforge.preprocess.samples.dataset import generate_dataset

    root = tmp_path_factory.mktemp("lerobot")
    return generate_dataset(root, episodes=2, frames=(150, 160), height=32, width=32, gop=100, seed=3)


@pytest.fixture
def decode_all():
    """fn(path) -> every frame of a video, RGB, by plain sequential decoding (the ground truth)."""
    import av
    import numpy as np

    def decode(path: str):
        with av.open(path) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])

    return decode
