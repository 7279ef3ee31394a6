"""Block codecs (FORMAT.md "Block codec"): bit-exact round trips for every codec,
the manifest records the codec (absent = plain zstd), unknown codecs are refused, the xxh3 covers
the stored bytes, and the FORMAT.md snippet decodes a delta root."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard

from loongforge.shared import blocks
from loongforge.shared.blocks import BLOCK_CODECS
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import ConfigError, FormatError, IntegrityError
from loongforge.shared.synthetic import make_synthetic_root, synthetic_dataset_info
from loongforge.shared.writer import RootWriter

LENGTHS = (23, 1, 40, 6)  # short last blocks, a one-frame episode, a multi-frame last episode


def _noise_root(root: str, codec: str, block_size: int = 4) -> dict:
    """Frames of uniform random bytes: every delta wraps around mod 256 somewhere."""
    info = synthetic_dataset_info(8, 16, ("front", "wrist"), 3, 2)
    rng = np.random.default_rng(7)
    written = {}
    with RootWriter(root, info, block_size=block_size, shard_size=1 << 14, block_codec=codec) as w:
        for ep, n in enumerate(LENGTHS):
            frames = {c: rng.integers(0, 256, size=(n, 12, 16), dtype=np.uint8) for c in ("front", "wrist")}
            arrays = {"state": np.zeros((n, 3)), "action": np.zeros((n, 2)), "timestamp": np.arange(n) / 20,
                      "frame_index": np.arange(n), "task_index": np.zeros(n, np.int64)}
            w.add_episode(ep, frames, arrays)
            written[ep] = frames
    return written


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_every_codec_round_trips_bit_exact(tmp_path, codec, block_size):
    written = _noise_root(str(tmp_path / "r"), codec, block_size)
    ds = open_root(str(tmp_path / "r"))
    assert ds.block_codec == codec
    out = np.empty((block_size, 12, 16), np.uint8)
    for e in range(ds.num_episodes):
        for cam in ds.cameras:
            got = np.concatenate([ds.read_block(e, cam, b) for b in range(ds.num_blocks(e))])
            np.testing.assert_array_equal(got, written[e][cam])
            np.testing.assert_array_equal(ds.read_block(e, cam, 0, out=out), written[e][cam][:block_size])
        both = ds.read_blocks(e, ds.num_blocks(e) - 1)
        for cam in ds.cameras:
            np.testing.assert_array_equal(both[cam], written[e][cam][(ds.num_blocks(e) - 1) * block_size:])


def test_manifest_records_the_codec_and_delta_stores_differences(tmp_path):
    make_synthetic_root(str(tmp_path / "z"))
    written = make_synthetic_root(str(tmp_path / "d"), block_codec="delta-zstd")
    plain, delta = open_root(str(tmp_path / "z")), open_root(str(tmp_path / "d"))
    assert "block_codec" not in plain.manifest["params"] and plain.block_codec == "zstd"
    assert delta.manifest["params"]["block_codec"] == "delta-zstd"
    name, off, length, n, _ = delta.block_entry(0, "front", 1)
    with open(tmp_path / "d" / name, "rb") as f:
        f.seek(off)
        stored = np.frombuffer(zstandard.ZstdDecompressor().decompress(f.read(length)), np.uint8)
    frames = written[0][0]["front"][4:8]
    stored = stored.reshape(frames.shape)
    np.testing.assert_array_equal(stored[0], frames[0])
    np.testing.assert_array_equal(stored[1:], frames[1:] - frames[:-1])  # uint8: mod 256
    assert not np.array_equal(stored, frames)


@pytest.mark.parametrize("codec", ["lz4-delta", ["zstd"], 3])
def test_unknown_codec_refused_with_hint(tmp_path, codec):
    root = str(tmp_path / "r")
    make_synthetic_root(root, block_codec="delta-zstd")
    path = os.path.join(root, "index.json")
    doc = json.load(open(path))
    doc["params"]["block_codec"] = codec
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"block codec .* unknown to this reader.*upgrade loongforge"):
        open_root(root)


def test_writer_rejects_unknown_codec(tmp_path):
    with pytest.raises(ConfigError, match="block_codec='rle'"):
        make_synthetic_root(str(tmp_path / "r"), block_codec="rle")


def test_xxh3_covers_the_stored_delta_bytes(tmp_path):
    root = str(tmp_path / "r")
    _noise_root(root, "delta-zstd")
    ds = open_root(root)
    name, off, length, _, _ = ds.block_entry(2, "wrist", 3)
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(IntegrityError, match="camera wrist block 3"):
        open_root(root).read_block(2, "wrist", 3)


def test_format_md_snippet_decodes_a_delta_root(tmp_path):
    """The FORMAT.md snippet, run as written on a delta-zstd root: its last frame sits mid-block."""
    root = str(tmp_path / "r")
    written = make_synthetic_root(root, lengths=(9, 7), block_codec="delta-zstd")
    text = (Path(blocks.__file__).parent / "FORMAT.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if '["format_version"] == 2' in b)
    ns: dict = {}
    exec(code.replace('root = "out"', f"root = {root!r}"), ns)
    assert (ns["e"], ns["t"], ns["codec"]) == (1, 6, "delta-zstd")
    np.testing.assert_array_equal(ns["frame"], written[1][0]["front"][6])
    np.testing.assert_array_equal(ns["frames"], written[1][0]["front"][4:7])
