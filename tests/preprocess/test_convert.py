"""`loongforge convert ROOT --to v2 OUT`: a format-1 root (written by the tests' own writer of the
FORMAT.md appendix, tests/legacy_v1.py, with overlapping windows over the frames and arrays the real
Beam job wrote from real mp4) rewritten as format 2 holds the same frames, state and actions as the
job's own root, with overlapping windows deduplicated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loongforge.cli import main
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import FormatError, FormatVersionError
from loongforge.shared.legacy import convert_root
from tests.legacy_v1 import v1_copy_of

K, STRIDE = 4, 2  # overlapping windows: every frame is stored twice in v1


@pytest.fixture(scope="module")
def roots(sample_dataset, tmp_path_factory, run_in_memory):
    base = tmp_path_factory.mktemp("convert")
    v1, direct = str(base / "v1"), str(base / "direct")
    run_in_memory(sample_dataset, direct, block_frames=4, val_episodes="2")
    doc = v1_copy_of(direct, v1, frames_per_sample=K, stride=STRIDE, action_horizon=4, min_frames=1)
    return v1, direct, base, doc


def test_convert_round_trip_equals_the_direct_job(roots, capsys):
    v1, direct, base, doc = roots
    out = str(base / "converted")
    assert main(["convert", v1, "--to", "v2", out, "--block-frames", "8", "--block-codec", "delta-zstd"]) == 0
    summary = json.loads(capsys.readouterr().out)
    conv, want = open_root(out), open_root(direct)
    assert summary["v1_samples"] == sum(len(s["keys"]) for s in doc["shards"])
    assert sum(sum(s["frames"]) for s in doc["shards"]) > conv.num_frames == summary["frames"]  # duplicates dropped
    assert conv.block_size == 8 and conv.num_episodes == want.num_episodes
    assert (conv.block_codec, want.block_codec) == ("delta-zstd", "zstd")  # same frames, either codec
    assert conv.manifest["split"] == {"val_episodes": [2]} and conv.stats == want.stats
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
    v1, _, base, _ = roots
    with pytest.raises(FormatError, match="not stored in the v1 root"):
        convert_root(v1, str(base / "strict"), strict=True)


def test_convert_refuses_v1_with_frame_gaps(roots, tmp_path):
    _, direct, _, _ = roots
    v1 = str(tmp_path / "gappy")
    v1_copy_of(direct, v1, frames_per_sample=2, stride=5, action_horizon=4)
    with pytest.raises(FormatError, match="in no v1 window"):
        convert_root(v1, str(tmp_path / "out"))


def test_convert_refuses_a_format_2_root_and_a_corrupt_sample(roots, tmp_path):
    v1, direct, _, doc = roots
    with pytest.raises(FormatVersionError, match="needs no conversion"):
        convert_root(direct, str(tmp_path / "out"))
    bad = str(tmp_path / "bad")
    import shutil

    shutil.copytree(v1, bad)
    shard = doc["shards"][0]
    path = f"{bad}/{shard['name']}"
    data = bytearray(open(path, "rb").read())
    data[shard["offsets"][0] + 600] ^= 0xFF  # one sample's bytes: the whole-shard sha256 fails first
    open(path, "wb").write(bytes(data))
    with pytest.raises(FormatError, match="sha256"):
        convert_root(bad, str(tmp_path / "out2"))


def test_only_the_convert_command_imports_the_format_1_reader():
    """Format 1 is read by `loongforge convert` alone: no other module of the package imports
    shared/legacy.py (a runtime path reading format 1 again would have to)."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    importers = set()
    for pkg in ("shared", "preprocess", "cache", "train", "benchmarks", "loongforge"):
        for path in (repo / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any(n == "loongforge.shared.legacy" for n in names) or (
                        isinstance(node, ast.ImportFrom) and node.module == "loongforge.shared"
                        and any(a.name == "legacy" for a in node.names)):
                    importers.add(str(path.relative_to(repo)))
    assert importers == {"preprocess/cli.py"}
