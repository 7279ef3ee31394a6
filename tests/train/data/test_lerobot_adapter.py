"""The LeRobot adapter against what LeRobot itself returns (../shared/fixtures/lerobot_v3/*_items.npz:
`LeRobotDataset(root, video_backend="pyav", delta_timestamps=...)[i]` from lerobot 0.6.1).

Every non-image value must be equal (keys, shapes, dtypes, padding flags, task strings); images
within the measured tolerance of LoongForge's NV12 -> RGB (train/README.md), and bit-exact for
video with the PyAV-matching colour mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.shared.errors import ConfigError
from loongforge.train.data.lerobot import LeRobotDataset
from loongforge.train.data.lerobot_loader import LeRobotLoader
from loongforge.train.data.loader import BlockLoader
from tests.outside import copy_fixture, fixture_dir

IN_MEMORY = ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
# Measured on the fixtures (train/README.md): |LoongForge RGB - PyAV's rgb24| / 255.
TOLERANCE = {"video": {"max": 3 / 255, "mean": 1.2 / 255}, "image": {"max": 104 / 255, "mean": 1.35 / 255}}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lerobot_adapter")
    out = {}
    for kind in ("video", "image"):
        src = copy_fixture(f"lerobot_v3/{kind}", tmp / kind)
        run_job(PreprocessConfig(input=str(src), output=str(tmp / f"{kind}_shards"), workers=1, block_frames=8),
                IN_MEMORY)
        spec = json.loads((fixture_dir("lerobot_v3") / f"{kind}_items.json").read_text())
        out[kind] = (str(tmp / f"{kind}_shards"), spec, np.load(fixture_dir("lerobot_v3") / f"{kind}_items.npz"), src)
    return out


def _compare(item: dict, want: dict, kind: str, exact_images: bool) -> tuple[float, float, int]:
    assert set(item) == set(want), set(item) ^ set(want)
    worst, total, count = 0.0, 0.0, 0
    for key, ref in want.items():
        got = item[key]
        if key == "task":
            assert got == str(ref)
            continue
        got = got.numpy()
        assert got.shape == ref.shape and got.dtype == ref.dtype, (key, got.shape, ref.shape, got.dtype, ref.dtype)
        if key.startswith("observation.images.") and not key.endswith("_is_pad") and not exact_images:
            diff = np.abs(got - ref)
            worst, total, count = max(worst, float(diff.max())), total + float(diff.sum()), count + diff.size
        else:
            np.testing.assert_array_equal(got, ref, err_msg=key)
    return worst, total, count


def _items(z, i: int) -> dict:
    return {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}/")}


@pytest.mark.parametrize("kind", ["video", "image"])
def test_items_equal_lerobots(roots, kind):
    root, spec, z, _ = roots[kind]
    ds = LeRobotDataset(root, delta_timestamps=spec["delta_timestamps"])
    assert len(ds) == spec["len"] and ds.num_episodes == spec["episodes"]
    worst, total, count = 0.0, 0.0, 0
    for i in z["indices"].tolist():
        w, t, c = _compare(ds[i], _items(z, i), kind, exact_images=False)
        worst, total, count = max(worst, w), total + t, count + c
    assert worst <= TOLERANCE[kind]["max"] + 1e-6 and total / count <= TOLERANCE[kind]["mean"], (worst * 255,
                                                                                                 total / count * 255)


def test_pyav_colour_is_bit_exact_for_video(roots):
    root, spec, z, _ = roots["video"]
    ds = LeRobotDataset(root, delta_timestamps=spec["delta_timestamps"], color="pyav")
    for i in z["indices"].tolist():
        _compare(ds[i], _items(z, i), "video", exact_images=True)


def test_fast_path_batches_are_the_same_items(roots):
    """Every index once per epoch, each row equal to the map-style item (so to LeRobot's)."""
    root, spec, _, _ = roots["video"]
    ref = LeRobotDataset(root, delta_timestamps=spec["delta_timestamps"])
    with LeRobotLoader(root, delta_timestamps=spec["delta_timestamps"], batch_size=13, num_workers=1) as loader:
        seen = []
        for _, batch in zip(range(len(loader)), loader):
            assert batch["observation.images.front"].shape == (13, 2, 3, 64, 96)
            assert batch["observation.images.wrist"].shape == (13, 3, 48, 48) and len(batch["task"]) == 13
            for row, idx in enumerate(batch["index"].tolist()):
                seen.append(idx)
                for key, value in ref[idx].items():
                    got = batch[key][row]
                    assert got == value if key == "task" else torch.equal(got, value), key
        state = loader.state_dict()
    assert sorted(seen) == list(range(len(ref)))  # 195 = 15 x 13: no tail dropped
    assert state["order"]["delta_indices"]["action"] == list(range(16))


def test_episode_boundaries_stats_and_selection(roots):
    import pyarrow.parquet as pq

    root, spec, _, src = roots["video"]
    meta = pq.read_table(src / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
    ds = LeRobotDataset(root)
    assert ds.episode_data_index["from"].tolist() == meta["dataset_from_index"]
    assert ds.episode_data_index["to"].tolist() == meta["dataset_to_index"]
    assert ds.meta.episodes["dataset_to_index"] == meta["dataset_to_index"] and ds.meta.total_frames == 195
    stats = json.loads((src / "meta/stats.json").read_text())
    assert set(ds.meta.stats) == set(stats)
    assert ds.meta.stats["observation.images.front"]["mean"].shape == (3, 1, 1)
    np.testing.assert_array_equal(ds.meta.stats["action"]["std"], np.asarray(stats["action"]["std"]))
    assert ds.meta.video_keys == ("observation.images.front", "observation.images.wrist") and ds.fps == 20
    item = ds[0]  # no delta_timestamps: the current frame, no padding flags (LeRobot's item)
    assert item["observation.state"].shape == (7,) and item["observation.images.wrist"].shape == (3, 48, 48)
    assert not any(k.endswith("_is_pad") for k in item)
    two = LeRobotDataset(root, episodes=[1, 3])
    assert len(two) == 60 + 52 and two[0]["episode_index"] == 1 and two[60]["index"] == 143
    assert two.episode_data_index["to"].tolist() == [60, 112]


def test_bad_requests_are_clear(roots):
    root, *_ = roots["video"]
    with pytest.raises(ConfigError, match="multiple of 1/fps"):
        LeRobotDataset(root, delta_timestamps={"action": [0.0, 0.033]})
    with pytest.raises(ConfigError, match="not in this root"):
        LeRobotDataset(root, delta_timestamps={"observation.images.side": [0.0]})
    with pytest.raises(ConfigError, match="episodes \\[9\\]"):
        LeRobotDataset(root, episodes=[9])
    with pytest.raises(IndexError):
        LeRobotDataset(root)[195]


def test_the_trainer_refuses_cameras_of_different_sizes(roots):
    root, *_ = roots["video"]
    with pytest.raises(ConfigError, match="different sizes .*--height H --width W"):
        BlockLoader(root, batch_size=4)
