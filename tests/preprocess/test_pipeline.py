"""The whole job on the local Beam runner over real generated datasets, read
back through the shared reader with hash verification. Format 1 (per-sample windows,
`--format-version 1`) is this file's subject; test_pipeline_v2.py covers the default."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loongforge.preprocess.decode import decode_nv12
from loongforge.preprocess.discover import discover
from loongforge.preprocess.sample_data import generate_preset
from loongforge.preprocess.window import plan_windows
from loongforge.shared import paths
from loongforge.shared.index import load_index
from loongforge.shared.reader import ShardReader

K, STRIDE, H = 4, 3, 6


def _parquet(root: str, episode: int):
    _, episodes = discover(root)
    spec = next(e for e in episodes if e.index == episode)
    t = pq.read_table(spec.parquet)
    return (np.array(t.column("observation.state").to_pylist(), np.float32),
            np.array(t.column("action").to_pylist(), np.float32), t.column("task_index").to_pylist(), spec)


@pytest.fixture(scope="module")
def converted(sample_dataset, tmp_path_factory, run_in_memory):
    out = str(tmp_path_factory.mktemp("shards") / "run1")
    summary = run_in_memory(sample_dataset, out, format_version=1, frames_per_sample=K, stride=STRIDE,
                            action_horizon=H, shard_size=1 << 16)
    return out, summary


def test_end_to_end_content(sample_dataset, converted):
    out, summary = converted
    meta, episodes = discover(sample_dataset)
    reader = ShardReader(out, verify=True)
    expected = sum(len(plan_windows(e.length, frames_per_sample=K, stride=STRIDE, frame_step=1, action_horizon=H,
                                    min_frames=2)) for e in episodes)
    assert len(reader) == expected == summary["samples"] and summary["episodes"] == 3 and summary["failed"] == 0
    assert summary["shards"] > 1  # 64 KB shards force several
    assert reader.verify() == []
    tasks = {int(k): v for k, v in reader.index.dataset.tasks.items()}
    videos = {}
    for sample in reader:
        state, action, task_index, spec = _parquet(sample_dataset, sample.episode)
        rows = sample.frame_indices
        assert np.array_equal(sample.state, state[rows])
        last = rows[-1]
        assert np.array_equal(sample.action[: sample.action_valid], action[last : last + sample.action_valid])
        assert (sample.action[sample.action_valid :] == action[-1]).all()
        assert sample.task == tasks[task_index[rows[0]]] == meta.tasks[task_index[rows[0]]]
        for key, path in spec.videos:
            slot = paths.camera_slot(key)
            if (sample.episode, slot) not in videos:
                videos[sample.episode, slot] = decode_nv12(path, len(state))[0]
            assert np.array_equal(sample.frames[slot], videos[sample.episode, slot][rows])  # lossless at source size
    assert not (Path(out) / "_staging").exists()
    assert (Path(out) / paths.FAILED_FILE).read_text() == ""


def test_index_dataset_info(sample_dataset, converted):
    out, _ = converted
    index = load_index(out)
    ds = index.dataset
    assert (ds.height, ds.width, ds.fps, ds.color_matrix, ds.color_range) == (64, 64, 20.0, "bt601", "limited")
    assert [(c.key, c.slot, c.source_height, c.codec) for c in ds.cameras] == [
        ("observation.images.ego_view", "ego_view", 64, "h264"), ("observation.images.wrist_view", "wrist_view", 64, "h264")]
    assert (ds.state_dim, ds.action_dim, ds.frames_per_sample, ds.action_horizon) == (8, 8, K, H)
    assert len(ds.state_names) == 8 and ds.state_names[-1] == "gripper_0"
    assert ds.modality == json.loads((Path(sample_dataset) / "meta/modality.json").read_text())
    assert ds.source["codebase_version"] == "v2.0" and len(ds.source["fingerprint"]) == 64
    _, episodes = discover(sample_dataset)
    assert ds.source["frames"] == sum(e.length for e in episodes)
    states = np.concatenate([_parquet(sample_dataset, e.index)[0] for e in episodes]).astype(np.float64)
    np.testing.assert_allclose(ds.stats["state"]["mean"], states.mean(0), atol=1e-9)
    np.testing.assert_allclose(ds.stats["state"]["std"], states.std(0), atol=1e-9)
    assert ds.stats["state"]["count"] == len(states)
    assert index.params["frames_per_sample"] == K and index.params["shard_size"] == 1 << 16
    frames = {n for s in index.shards for n in s.frames}
    assert frames <= set(range(2, K + 1)) and K in frames


def test_rerun_is_byte_identical_and_clears_stale_shards(sample_dataset, converted, tmp_path, run_in_memory):
    out, _ = converted
    again = str(tmp_path / "run2")
    run_in_memory(sample_dataset, again, format_version=1, frames_per_sample=K, stride=STRIDE, action_horizon=H,
                  shard_size=1 << 16)
    a, b = load_index(out), load_index(again)
    assert [(s.name, s.sha256) for s in a.shards] == [(s.name, s.sha256) for s in b.shards]
    assert (Path(out) / "index.json").read_bytes() == (Path(again) / "index.json").read_bytes()
    # Same output root, bigger shards: fewer shard files, the old extra ones are gone.
    run_in_memory(sample_dataset, again, format_version=1, frames_per_sample=K, stride=STRIDE, action_horizon=H,
                  shard_size=1 << 30)
    assert sorted(p.name for p in (Path(again) / "shards").iterdir()) == ["shard-000000.tar"]
    assert len(ShardReader(again, verify=True)) == a.num_samples


def test_bad_input_is_reported_not_fatal(quirky_dataset, tmp_path, caplog, run_in_memory):
    out = str(tmp_path / "q")
    with caplog.at_level(logging.WARNING):
        summary = run_in_memory(quirky_dataset, out, format_version=1)
    failed = [json.loads(line) for line in (Path(out) / paths.FAILED_FILE).read_text().splitlines()]
    assert [(r["episode"], r["camera"]) for r in failed] == [(1, "observation.images.ego_view"),
                                                            (3, "observation.images.ego_view")]
    assert "unreadable video" in failed[0]["reason"] and "length mismatch" in failed[1]["reason"]
    assert summary["failed"] == 2 and summary["episodes"] == 2
    reader = ShardReader(out, verify=True)
    assert {s.episode for s in reader} == {0, 2}
    assert list(reader.index.failed) == failed
    # metadata quirks: warned about, recorded, tolerated
    warnings = reader.index.dataset.source["warnings"]
    assert any("total_chunks: 0" in w for w in warnings) and any("goes beyond" in w for w in warnings)
    assert any("side_view" in w for w in warnings)
    assert [c.slot for c in reader.index.dataset.cameras] == ["ego_view", "wrist_view"]
    assert "side_view" in caplog.text


def test_gr00t_like_preset_with_resize(tmp_path, run_in_memory):
    root = str(generate_preset(tmp_path / "gr1", "gr00t-like", episodes=2, frames=(9, 12)))
    out = str(tmp_path / "out")
    summary = run_in_memory(root, out, format_version=1, height=64, width=64, frames_per_sample=2, stride=2,
                            action_horizon=4)
    assert summary["failed"] == 0 and summary["episodes"] == 2
    index = load_index(out)
    ds = index.dataset
    assert (ds.state_dim, ds.action_dim, ds.height, ds.width) == (44, 44, 64, 64)
    assert ds.cameras[0].source_height == 256 and ds.modality["state"]["left_arm"] == {"start": 0, "end": 7}
    sample = ShardReader(out, verify=True)[0]
    assert sample.frames["ego_view"].shape == (2, 96, 64) and sample.state.shape == (2, 44)


def test_missing_parquet_and_missing_video_are_failed_records(tmp_path, run_in_memory):
    from loongforge.preprocess.sample_data import generate_dataset

    root = generate_dataset(tmp_path / "ds", episodes=3, frames=(8, 10), gop=4)
    (root / "data/chunk-000/episode_000001.parquet").unlink()
    (root / "videos/chunk-000/observation.images.wrist_view/episode_000002.mp4").unlink()
    out = str(tmp_path / "out")
    summary = run_in_memory(str(root), out, format_version=1)
    assert summary["episodes"] == 1 and summary["failed"] == 2
    failed = load_index(out).failed
    assert failed[0]["episode"] == 1 and failed[0]["camera"] is None and "parquet file missing" in failed[0]["reason"]
    assert failed[1] == {"episode": 2, "camera": "observation.images.wrist_view",
                         "reason": "videos/chunk-000/observation.images.wrist_view/episode_000002.mp4: video file missing"}
    assert {s.episode for s in ShardReader(out, verify=True)} == {0}


def test_rgb_from_shards_matches_pyav_rgb_with_the_index_colour_info(sample_dataset, converted):
    import av

    out, _ = converted
    reader = ShardReader(out)
    sample = reader[len(reader) // 2]
    _, _, _, spec = _parquet(sample_dataset, sample.episode)
    key, path = spec.videos[1]
    with av.open(path) as c:
        ref = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    rgb = reader.rgb(sample, paths.camera_slot(key))  # uses the index's color_matrix / color_range
    for got, row in zip(rgb, sample.frame_indices):
        mse = np.mean((got.astype(np.float64) - ref[row]) ** 2)
        assert 10 * np.log10(255.0**2 / max(mse, 1e-12)) >= 35.0
