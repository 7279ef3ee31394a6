"""`loongforge convert ROOT --to v2 OUT`: a real v1 root (Beam job over real mp4)
rewritten as v2 holds the same frames, state and actions as the v2 job writes
from the source, with overlapping windows deduplicated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loongforge.cli import main
from loongforge.shared.convert_v1 import convert_v1_to_v2
from loongforge.shared.dataset_v2 import open_v2
from loongforge.shared.errors import FormatError
from loongforge.shared.index import load_index

K, STRIDE = 4, 2  # overlapping windows: every frame is stored twice in v1


@pytest.fixture(scope="module")
def roots(sample_dataset, tmp_path_factory, run_in_memory):
    base = tmp_path_factory.mktemp("convert")
    v1, direct = str(base / "v1"), str(base / "direct")
    run_in_memory(sample_dataset, v1, format_version=1, frames_per_sample=K, stride=STRIDE, action_horizon=4,
                  min_frames=1, shard_size=1 << 16, val_episodes="2")
    run_in_memory(sample_dataset, direct, format_version=2, block_frames=4)
    return v1, direct, base


def test_convert_round_trip_equals_the_direct_v2_job(roots, capsys):
    v1, direct, base = roots
    out = str(base / "converted")
    assert main(["convert", v1, "--to", "v2", out, "--block-frames", "8", "--block-codec", "delta-zstd"]) == 0
    summary = json.loads(capsys.readouterr().out)
    conv, want = open_v2(out), open_v2(direct)
    assert summary["v1_samples"] == load_index(v1).num_samples
    assert load_index(v1).num_frames > conv.num_frames == summary["frames"]  # duplicates dropped
    assert conv.block_size == 8 and conv.num_episodes == want.num_episodes
    assert (conv.block_codec, want.block_codec) == ("delta-zstd", "zstd")  # same frames, either codec
    assert conv.manifest["split"] == {"val_episodes": [2]} and conv.stats == load_index(v1).dataset.stats
    assert conv.verify() == []
    for e in range(conv.num_episodes):
        assert conv.episode_id(e) == want.episode_id(e) and conv.episode_lengths[e] == want.episode_lengths[e]
        for cam in conv.cameras:
            got = np.concatenate([conv.read_block(e, cam, b) for b in range(conv.num_blocks(e))])
            ref = np.concatenate([want.read_block(e, cam, b) for b in range(want.num_blocks(e))])
            np.testing.assert_array_equal(got, ref)
        a, r = conv.read_arrays(e), want.read_arrays(e)
        for name in ("state", "frame_index", "task_index"):
            np.testing.assert_array_equal(a[name], r[name])
        np.testing.assert_allclose(a["timestamp"], r["timestamp"], atol=1e-6)  # v1 meta rounds to 6 decimals
        known = a["action_known"]  # v1 stores actions from a window's last frame on: not for frames 0..K-2
        assert not known[: K - 1].any() and known[K - 1 :].all()
        np.testing.assert_array_equal(a["action"][known], r["action"][known])
        np.testing.assert_array_equal(a["action"][: K - 1], np.repeat(r["action"][K - 1 : K], K - 1, axis=0))


def test_convert_strict_refuses_missing_actions(roots):
    v1, _, base = roots
    with pytest.raises(FormatError, match="not stored in the v1 root"):
        convert_v1_to_v2(v1, str(base / "strict"), strict=True)


def test_convert_refuses_v1_with_frame_gaps(sample_dataset, tmp_path, run_in_memory):
    v1 = str(tmp_path / "gappy")
    run_in_memory(sample_dataset, v1, format_version=1, frames_per_sample=2, stride=5)
    with pytest.raises(FormatError, match="in no v1 window"):
        convert_v1_to_v2(v1, str(tmp_path / "out"))
