"""`--format-version 2`: the real job on Beam's FnApiRunner over real H.264 mp4,
read back through the v2 reader: every frame once, arrays once per episode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loongforge.preprocess.decode import decode_nv12
from loongforge.preprocess.discover import discover
from loongforge.preprocess.report import summarize
from loongforge.shared import paths
from loongforge.shared.dataset import open_root

B = 4


@pytest.fixture(scope="module")
def converted_v2(sample_dataset, tmp_path_factory, run_in_memory):
    out = str(tmp_path_factory.mktemp("shards") / "v2")
    # delta-zstd here (the zstd default runs in test_convert_v1's direct job and the determinism test)
    summary = run_in_memory(sample_dataset, out, format_version=2, block_frames=B, shard_size=1 << 16,
                            val_episodes="1", block_codec="delta-zstd")
    return out, summary


def test_v2_job_stores_every_frame_once(sample_dataset, converted_v2):
    out, summary = converted_v2
    meta, episodes = discover(sample_dataset)
    ds = open_root(out)
    assert ds.verify() == []
    assert ds.block_size == B and ds.manifest["params"]["format_version"] == 2
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


def test_v2_stats_exclude_val_and_summary(converted_v2):
    out, _ = converted_v2
    ds = open_root(out)
    train = [e for e in range(ds.num_episodes) if ds.split(e) == "train"]
    state = np.concatenate([ds.read_arrays(e)["state"] for e in train]).astype(np.float64)
    np.testing.assert_allclose(ds.stats["state"]["mean"], state.mean(0), rtol=1e-5, atol=1e-6)
    s = summarize(out)
    assert s["format_version"] == 2 and s["block_size"] == B and s["bytes_out"] > 0
    assert s["block_codec"] == "delta-zstd"


def test_inspect_verifies_a_v2_root(converted_v2, capsys):
    from loongforge.cli import main

    out, _ = converted_v2
    assert main(["inspect", out, "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["format_version"] == 2 and doc["samples"] == open_root(out).num_frames


def test_v2_job_is_deterministic_and_records_failures(quirky_dataset, tmp_path, run_in_memory):
    """Failed inputs become records (not a dead job), and two runs give identical bytes."""
    outs = [str(tmp_path / f"r{i}") for i in range(2)]
    for out in outs:
        summary = run_in_memory(quirky_dataset, out, format_version=2, block_frames=B)
    assert summary["failed"] >= 1
    failed = [json.loads(line) for line in (Path(outs[0]) / paths.FAILED_FILE).read_text().splitlines()]
    assert len(failed) == summary["failed"] and open_root(outs[0]).manifest["failed"] == failed
    for rel in ["index.json", *(s["name"] for s in open_root(outs[0]).manifest["shards"]), "index/blocks.npy"]:
        assert (Path(outs[0]) / rel).read_bytes() == (Path(outs[1]) / rel).read_bytes(), rel
