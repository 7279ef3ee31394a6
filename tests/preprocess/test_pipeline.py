"""The whole job on Beam's FnApiRunner over real generated datasets (real H.264 mp4), read back
through the reader with hash verification: every frame once, arrays once per episode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.stages.discover import discover
from loongforge.shared.summary import summarize
from loongforge.preprocess.samples.dataset import generate_preset
from loongforge.shared import paths
from loongforge.shared.dataset import open_root

B = 4


@pytest.fixture(scope="module")
def converted(sample_dataset, tmp_path_factory, run_in_memory):
    out = str(tmp_path_factory.mktemp("shards") / "run1")
    # delta-zstd here (the zstd default runs in test_convert's direct job and the determinism test)
    summary = run_in_memory(sample_dataset, out, block_frames=B, shard_size=1 << 16, val_episodes="1",
                            block_codec="delta-zstd", action_horizon=6)
    return out, summary


def test_job_stores_every_frame_once(sample_dataset, converted):
    out, summary = converted
    meta, episodes = discover(sample_dataset)
    ds = open_root(out)
    assert ds.verify() == []
    assert ds.block_size == B and ds.manifest["format_version"] == 2 and ds.manifest["params"]["block_size"] == B
    assert ds.block_codec == "delta-zstd" == ds.manifest["params"]["block_codec"]
    assert ds.num_episodes == 3 == summary["episodes"] and summary["failed"] == 0
    assert summary["samples"] == ds.num_frames == sum(e.length for e in episodes)
    assert len(ds.manifest["shards"]) > 1  # 64 KB shards force several
    assert ds.info.frames_per_sample == 1 and ds.cameras == ["ego_view", "wrist_view"]
    assert [ds.split(e) for e in range(3)] == ["train", "val", "train"]
    for e in range(ds.num_episodes):
        spec = next(s for s in episodes if s.index == ds.episode_id(e))
        table = pq.read_table(spec.parquet)
        arrays = ds.read_arrays(e)
        np.testing.assert_array_equal(arrays["state"], np.array(table.column("observation.state").to_pylist(),
                                                                np.float32))
        np.testing.assert_array_equal(arrays["action"], np.array(table.column("action").to_pylist(), np.float32))
        np.testing.assert_array_equal(arrays["task_index"], table.column("task_index").to_numpy())
        np.testing.assert_allclose(arrays["timestamp"], table.column("timestamp").to_numpy())
        for key, path in spec.videos:
            slot = paths.camera_slot(key)
            want = decode_nv12(path, spec.length)[0]
            got = np.concatenate([ds.read_block(e, slot, b) for b in range(ds.num_blocks(e))])
            np.testing.assert_array_equal(got, want)  # lossless at source size
    assert not (Path(out) / "_staging").exists()
    assert (Path(out) / paths.FAILED_FILE).read_text() == ""


def test_stats_exclude_val_and_summary(converted):
    out, _ = converted
    ds = open_root(out)
    train = [e for e in range(ds.num_episodes) if ds.split(e) == "train"]
    state = np.concatenate([ds.read_arrays(e)["state"] for e in train]).astype(np.float64)
    np.testing.assert_allclose(ds.stats["state"]["mean"], state.mean(0), rtol=1e-5, atol=1e-6)
    s = summarize(out)
    assert s["format_version"] == 2 and s["block_size"] == B and s["bytes_out"] > 0
    assert s["block_codec"] == "delta-zstd"


def test_inspect_verifies_a_root(converted, capsys):
    from loongforge.cli import main

    out, _ = converted
    assert main(["inspect", out, "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["format_version"] == 2 and doc["samples"] == open_root(out).num_frames


def test_job_is_deterministic_and_records_failures(quirky_dataset, tmp_path, run_in_memory, caplog):
    """Failed inputs become records (not a dead job), and two runs give identical bytes. The short
    video's rows past its end have no frame: under --frame-mismatch fail its episode is a record
    (the default clamps them: tests/preprocess/test_timing.py)."""
    import logging

    outs = [str(tmp_path / f"r{i}") for i in range(2)]
    for out in outs:
        with caplog.at_level(logging.WARNING):
            summary = run_in_memory(quirky_dataset, out, block_frames=B, frame_mismatch="fail")
    assert summary["failed"] >= 1
    failed = [json.loads(line) for line in (Path(outs[0]) / paths.FAILED_FILE).read_text().splitlines()]
    assert len(failed) == summary["failed"] and open_root(outs[0]).manifest["failed"] == failed
    for rel in ["index.json", *(s["name"] for s in open_root(outs[0]).manifest["shards"]), "index/blocks.npy"]:
        assert (Path(outs[0]) / rel).read_bytes() == (Path(outs[1]) / rel).read_bytes(), rel
    assert [(r["episode"], r["camera"]) for r in failed] == [(1, "observation.images.ego_view"),
                                                            (3, "observation.images.ego_view")]
    assert "unreadable video" in failed[0]["reason"] and "has no frame within" in failed[1]["reason"]
    assert summary["failed"] == 2 and summary["episodes"] == 2
    ds = open_root(outs[0])
    assert ds.verify() == [] and [ds.episode_id(e) for e in range(ds.num_episodes)] == [0, 2]
    # metadata quirks: warned about, recorded, tolerated
    warnings = ds.info.source["warnings"]
    assert any("total_chunks: 0" in w for w in warnings) and any("goes beyond" in w for w in warnings)
    assert any("side_view" in w for w in warnings) and "side_view" in caplog.text
    assert ds.cameras == ["ego_view", "wrist_view"]


def test_dataset_info_in_the_manifest(sample_dataset, converted):
    out, _ = converted
    ds = open_root(out)
    info = ds.info
    assert (info.height, info.width, info.fps, info.color_matrix, info.color_range) == (64, 64, 20.0, "bt601",
                                                                                         "limited")
    assert [(c.key, c.slot, c.source_height, c.codec) for c in info.cameras] == [
        ("observation.images.ego_view", "ego_view", 64, "h264"),
        ("observation.images.wrist_view", "wrist_view", 64, "h264")]
    assert (info.state_dim, info.action_dim, info.frames_per_sample, info.action_horizon) == (8, 8, 1, 6)
    assert len(info.state_names) == 8 and info.state_names[-1] == "gripper_0"
    assert info.modality == json.loads((Path(sample_dataset) / "meta/modality.json").read_text())
    assert info.source["codebase_version"] == "v2.0" and len(info.source["fingerprint"]) == 64
    _, episodes = discover(sample_dataset)
    assert info.source["frames"] == sum(e.length for e in episodes)
    assert ds.manifest["params"]["shard_size"] == 1 << 16 and ds.manifest["params"]["action_horizon"] == 6


def test_rerun_clears_stale_shards(sample_dataset, tmp_path, run_in_memory):
    """Same output root, bigger shards: fewer shard files, the old extra ones are gone."""
    out = str(tmp_path / "run")
    run_in_memory(sample_dataset, out, block_frames=B, shard_size=1 << 16)
    assert len(list((Path(out) / "shards").iterdir())) > 1
    run_in_memory(sample_dataset, out, block_frames=B, shard_size=1 << 30)
    assert sorted(p.name for p in (Path(out) / "shards").iterdir()) == ["shard-000000.tar"]
    assert open_root(out).verify() == []


def test_gr00t_like_preset_with_resize(tmp_path, run_in_memory):
    root = str(generate_preset(tmp_path / "gr1", "gr00t-like", episodes=2, frames=(9, 12)))
    out = str(tmp_path / "out")
    summary = run_in_memory(root, out, height=64, width=64, action_horizon=4)
    assert summary["failed"] == 0 and summary["episodes"] == 2
    ds = open_root(out)
    info = ds.info
    assert (info.state_dim, info.action_dim, info.height, info.width) == (44, 44, 64, 64)
    assert info.cameras[0].source_height == 256 and info.modality["state"]["left_arm"] == {"start": 0, "end": 7}
    assert ds.read_block(0, "ego_view", 0).shape[1:] == (96, 64) and ds.read_arrays(0)["state"].shape[1] == 44


def test_missing_parquet_and_missing_video_are_failed_records(tmp_path, run_in_memory):
    from loongforge.preprocess.samples.dataset import generate_dataset

    root = generate_dataset(tmp_path / "ds", episodes=3, frames=(8, 10), gop=4)
    (root / "data/chunk-000/episode_000001.parquet").unlink()
    (root / "videos/chunk-000/observation.images.wrist_view/episode_000002.mp4").unlink()
    out = str(tmp_path / "out")
    summary = run_in_memory(str(root), out)
    assert summary["episodes"] == 1 and summary["failed"] == 2
    ds = open_root(out)
    failed = ds.manifest["failed"]
    assert failed[0]["episode"] == 1 and failed[0]["camera"] is None and "parquet file missing" in failed[0]["reason"]
    assert failed[1] == {"episode": 2, "camera": "observation.images.wrist_view",
                         "reason": "videos/chunk-000/observation.images.wrist_view/episode_000002.mp4: video file missing"}
    assert [ds.episode_id(e) for e in range(ds.num_episodes)] == [0]


def test_rgb_from_shards_matches_pyav_rgb_with_the_index_colour_info(sample_dataset, converted):
    import av

    from loongforge.shared.color import nv12_to_rgb

    out, _ = converted
    ds = open_root(out)
    _, episodes = discover(sample_dataset)
    e = 1
    spec = next(s for s in episodes if s.index == ds.episode_id(e))
    key, path = spec.videos[1]
    with av.open(path) as c:
        ref = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    slot = paths.camera_slot(key)
    frames = np.concatenate([ds.read_block(e, slot, b) for b in range(ds.num_blocks(e))])
    rgb = nv12_to_rgb(frames, ds.info.color_matrix, ds.info.color_range)  # the index's matrix and range
    for got, want in zip(rgb, ref, strict=True):
        mse = np.mean((got.astype(np.float64) - want) ** 2)
        assert 10 * np.log10(255.0**2 / max(mse, 1e-12)) >= 35.0
