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


def test_the_last_partial_batch_is_kept_as_a_dataloader_keeps_it(roots):
    """195 items at batch 32: 6 full batches and one of 3, every index exactly once per epoch
    (DataLoader's drop_last=False); drop_last=True leaves the 3 out."""
    root, spec, _, _ = roots["video"]
    deltas = {"action": spec["delta_timestamps"]["action"]}
    with LeRobotLoader(root, delta_timestamps=deltas, batch_size=32, num_workers=0, max_steps=8) as loader:
        assert len(loader) == 7
        batches = list(loader)
    sizes = [len(b["index"]) for b in batches]
    assert sizes == [32] * 6 + [3, 32]  # the 8th step starts epoch 2
    assert sorted(i for b in batches[:7] for i in b["index"].tolist()) == list(range(195))
    tail = batches[6]
    assert tail["action"].shape == (3, 16, 7) and len(tail["task"]) == 3 and tail["action_is_pad"].shape == (3, 16)
    with LeRobotLoader(root, delta_timestamps=deltas, batch_size=32, drop_last=True, max_steps=7) as loader:
        assert len(loader) == 6 and [len(b["index"]) for b in loader] == [32] * 7


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


def test_the_trainer_reads_cameras_of_different_sizes_each_at_its_own(roots):
    """N1.6 letterboxes and resizes every camera itself: a root keeping each camera at its source size
    trains as it is (one frames field per camera, each its own size)."""
    root, *_ = roots["video"]
    from loongforge.shared.dataset import open_root

    info = open_root(root).info
    assert not info.uniform_size
    with BlockLoader(root, batch_size=4, rgb=False) as loader:
        batch = next(iter(loader))
    for i, slot in enumerate(info.slots):
        h, w = info.camera_size(i)
        assert tuple(batch["frames"][slot].shape[-2:]) == (h * 3 // 2, w)


@pytest.fixture(scope="module")
def many_columns(tmp_path_factory):
    """GR00T-like sample data in LeRobot v3.0 with more columns: float64, a float vector, a string
    (beside next.done bool and the annotation.* ints the sample data has)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loongforge.preprocess.samples.dataset import generate_dataset
    from loongforge.preprocess.samples.layouts import write_v3

    tmp = tmp_path_factory.mktemp("columns")
    src = write_v3(generate_dataset(tmp / "v2", episodes=2, frames=(6, 9), height=32, width=32,
                                    cameras=("ego_view",)), tmp / "v3", codec="h264", gop=2)
    path = src / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    n = table.num_rows
    table = table.append_column("next.reward", pa.array(np.linspace(0, 1, n), pa.float64()))
    env = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    table = table.append_column("observation.environment_state",
                                pa.FixedSizeListArray.from_arrays(pa.array(env.reshape(-1)), 3))
    table = table.append_column("note", pa.array([f"row {i}" for i in range(n)]))
    pq.write_table(table, path)
    info = json.loads((src / "meta/info.json").read_text())
    info["features"].update({"next.reward": {"dtype": "float64", "shape": [1], "names": None},
                             "observation.environment_state": {"dtype": "float32", "shape": [3], "names": None},
                             "note": {"dtype": "string", "shape": [1], "names": None}})
    (src / "meta/info.json").write_text(json.dumps(info))
    out = tmp / "shards"
    run_job(PreprocessConfig(input=str(src), output=str(out), workers=1), IN_MEMORY)
    return src, str(out), table


def test_the_item_holds_every_parquet_column_as_lerobot_types_it(many_columns):
    """LeRobot's item: each row of its `datasets` table (the info.json features) through
    `torch.tensor(python value)` (hf_transform_to_torch): floats float32, ints int64, bools bool,
    strings str; no key the dataset does not have. Deltas on any column, as LeRobot queries them."""
    _, root, table = many_columns
    rows = table.to_pylist()
    ds = LeRobotDataset(root)
    assert len(ds) == len(rows)
    tasks = ds.tasks
    for i in (0, 5, len(rows) - 1):
        item, row = ds[i], rows[i]
        assert set(item) == set(row) | {"observation.images.ego_view", "task"}
        for key, value in row.items():
            want = value if isinstance(value, str) else torch.tensor(value)
            got = item[key]
            if isinstance(want, str):
                assert got == want, key
            else:
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
        assert item["task"] == tasks[row["task_index"]] and item["next.done"].dtype == torch.bool
    with_deltas = LeRobotDataset(root, delta_timestamps={"next.reward": [-0.05, 0.0], "next.done": [0.0, 0.05]})
    item = with_deltas[0]
    assert item["next.reward"].dtype == torch.float32 and item["next.reward_is_pad"].tolist() == [True, False]
    assert item["next.done"].shape == (2,) and item["next.done_is_pad"].tolist() == [False, False]
    with pytest.raises(ConfigError, match="string columns"):
        LeRobotDataset(root, delta_timestamps={"note": [0.0]})
    with pytest.raises(ConfigError, match="hold strings"):
        LeRobotLoader(root, batch_size=2)


def test_a_root_without_frame_index_gives_no_frame_index(tmp_path):
    """A dataset without a frame_index column (GR00T's demo data) gets no frame_index key."""
    import pyarrow.parquet as pq

    src = copy_fixture("lerobot_v3/video", tmp_path / "video")
    path = src / "data/chunk-000/file-000.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["frame_index"]), path)
    info = json.loads((src / "meta/info.json").read_text())
    del info["features"]["frame_index"]
    (src / "meta/info.json").write_text(json.dumps(info))
    run_job(PreprocessConfig(input=str(src), output=str(tmp_path / "out"), workers=1), IN_MEMORY)
    item = LeRobotDataset(str(tmp_path / "out"))[3]
    assert "frame_index" not in item and item["index"] == 3 and item["timestamp"] == np.float32(0.15)
