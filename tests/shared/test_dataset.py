"""The shard format (FORMAT.md): writer + reader round trip, integrity on every read,
version refusal (format 1 with the convert hint), the FORMAT.md snippet, shared
memory-mapped tables."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from loongforge.shared import dataset as dataset_module
from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.errors import FormatError, FormatVersionError, IntegrityError
from loongforge.shared.source import OriginSource
from loongforge.shared.synthetic import make_synthetic_root

LENGTHS = (23, 9, 40, 17, 1)
IDS = (4, 7, 8, 12, 30)


@pytest.fixture
def written_root(tmp_path):
    root = str(tmp_path / "root")
    written = make_synthetic_root(root, lengths=LENGTHS, episode_ids=IDS, block_size=4, shard_size=1 << 15,
                                     val_episodes=(8,))
    return root, written


def test_round_trip_every_block_and_array(written_root):
    root, written = written_root
    ds = open_root(root)
    assert ds.num_episodes == len(IDS) and ds.num_frames == sum(LENGTHS) and ds.block_size == 4
    assert ds.cameras == ["front", "wrist"] and ds.frame_shape("front") == (24, 16)
    assert list(ds.episode_lengths) == list(LENGTHS) and ds.episode_lengths.dtype == np.int64
    assert len(ds.manifest["shards"]) > 1, "the fixture must span shards"
    for e in range(ds.num_episodes):
        frames, arrays = written[ds.episode_id(e)]
        for cam in ds.cameras:
            blocks = [ds.read_block(e, cam, b) for b in range(ds.num_blocks(e))]
            assert all(len(b) == 4 for b in blocks[:-1]) and 1 <= len(blocks[-1]) <= 4  # last may be short
            np.testing.assert_array_equal(np.concatenate(blocks), frames[cam])
        got = ds.read_arrays(e)
        assert sorted(got) == ["action", "frame_index", "state", "task_index", "timestamp"]
        assert got["state"].dtype == np.float32 and got["timestamp"].dtype == np.float64
        for name in got:
            np.testing.assert_array_equal(got[name], np.asarray(arrays[name]).astype(got[name].dtype))
    assert [ds.split(e) for e in range(ds.num_episodes)] == ["train", "train", "val", "train", "train"]
    assert list(ds.val_mask) == [False, False, True, False, False]
    assert ds.stats["state"]["mean"] == [0.0] * 6


def test_locate_and_block_of_match_brute_force(written_root):
    ds = open_root(written_root[0])
    pairs = [(e, t) for e, n in enumerate(LENGTHS) for t in range(n)]
    assert [ds.locate(n) for n in range(ds.num_frames)] == pairs
    with pytest.raises(IndexError):
        ds.locate(ds.num_frames)
    assert ds.block_of(9) == (2, 1) and ds.block_of(0) == (0, 0)
    # the frame tag (first luma byte) says which frame a block position holds
    e, t = ds.locate(30)
    b, i = ds.block_of(t)
    assert ds.read_block(e, "wrist", b)[i, 0, 0] == t


def test_read_block_into_preallocated_buffer(written_root):
    ds = open_root(written_root[0])
    buf = np.empty((ds.block_size, *ds.frame_shape("front")), np.uint8)
    got = ds.read_block(0, "front", ds.num_blocks(0) - 1, out=buf)  # 23 frames: last block holds 3
    assert got.shape[0] == 3 and np.shares_memory(got, buf)
    with pytest.raises(KeyError, match="not in this dataset"):
        ds.read_block(0, "side", 0)
    with pytest.raises(IndexError):
        ds.read_block(0, "front", ds.num_blocks(0))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_corrupt_block_byte_raises_integrity_error_naming_the_block(written_root):
    root, _ = written_root
    ds = open_root(root)
    name, off, length, _, _ = ds.block_entry(2, "wrist", 3)
    _flip(os.path.join(root, name), off + length // 2)
    ds = open_root(root)
    with pytest.raises(IntegrityError, match=rf"{name}: episode 8 camera wrist block 3"):
        ds.read_block(2, "wrist", 3)
    ds.read_block(2, "front", 3)  # its neighbour is intact
    assert any(name in bad for bad in ds.verify())


def test_corrupt_arrays_byte_raises_integrity_error(written_root):
    root, _ = written_root
    ds = open_root(root)
    off, length, _ = ds.tables["episode_arrays"][1].tolist()
    name = ds.block_entry(1, 0, 0)[0]
    _flip(os.path.join(root, name), off + length - 600)  # inside the last .npy payload
    with pytest.raises(IntegrityError, match="episode 7 arrays"):
        open_root(root).read_arrays(1)


def test_truncated_shard_is_an_integrity_error(written_root):
    root, _ = written_root
    ds = open_root(root)
    e = ds.num_episodes - 2
    name, off, _, _, _ = ds.block_entry(e, "front", ds.num_blocks(e) - 1)
    os.truncate(os.path.join(root, name), off + 3)
    ds = open_root(root)
    with pytest.raises(IntegrityError, match="truncated"):
        ds.read_block(e, "front", ds.num_blocks(e) - 1)
    with pytest.raises(IntegrityError):
        ds.source.read_shard(name)


def test_truncated_or_missing_table_refused_on_open(written_root):
    root, _ = written_root
    path = os.path.join(root, "index", "blocks.npy")
    os.truncate(path, os.path.getsize(path) - 64)
    with pytest.raises(IntegrityError, match="blocks.npy"):
        open_root(root)
    os.unlink(path)
    with pytest.raises(FormatError, match="missing"):
        open_root(root)


@pytest.mark.parametrize("version, hint", [(3, "upgrade loongforge"), (0, "re-run `loongforge preprocess`"),
                                           (1, "loongforge convert ROOT --to v2 OUT")])
def test_unknown_version_refused_with_hint(written_root, version, hint):
    root, _ = written_root
    path = os.path.join(root, "index.json")
    doc = json.load(open(path))
    doc["format_version"] = version
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(FormatVersionError, match=re.escape(hint)):
        open_root(root)


def test_a_format_1_root_is_refused_in_one_line_naming_the_converter(written_root, tmp_path):
    """Every reader opens a root here (open_root, or load_shard_index for the cache daemon): a real
    format-1 root (the FORMAT.md appendix, tests/legacy_v1.py) is refused with the command that fixes it."""
    from tests.legacy_v1 import v1_copy_of

    v1 = str(tmp_path / "v1")
    v1_copy_of(written_root[0], v1, frames_per_sample=2, stride=2, action_horizon=4)
    for read in (open_root, load_shard_index):
        with pytest.raises(FormatVersionError) as info:
            read(v1)
        msg = str(info.value)
        assert "\n" not in msg and "format_version 1" in msg and "`loongforge convert ROOT --to v2 OUT`" in msg


def test_shard_level_index_serves_origin_and_cache(written_root):
    root, _ = written_root
    index = load_shard_index(root)
    assert [s.name for s in index.shards] == [s["name"] for s in open_root(root).manifest["shards"]]
    assert index.shards == open_root(root).shard_index.shards and index.val_episodes == (8,)
    for entry in index.shards:  # size + sha256 of every shard checks out
        assert len(OriginSource(root, index).read_shard(entry.name)) == entry.bytes


def test_custom_source_is_used_for_every_read(written_root):
    root, _ = written_root
    calls = []

    class Counting(OriginSource):
        def read_range(self, name, offset, length):
            calls.append(name)
            return super().read_range(name, offset, length)

    ds = open_root(root, source=lambda index: Counting(root, index))
    ds.read_block(0, "front", 0)
    ds.read_arrays(1)
    assert len(calls) == 2


def test_shards_are_plain_tar_with_webdataset_keys(written_root):
    root, _ = written_root
    ds = open_root(root)
    names = tarfile.open(os.path.join(root, ds.manifest["shards"][0]["name"])).getnames()
    assert names[:5] == [f"e000004.{n}.npy" for n in ("action", "frame_index", "state", "task_index", "timestamp")]
    assert names[5:8] == ["e000004_b000000.front.nv12.zst", "e000004_b000000.wrist.nv12.zst",
                          "e000004_b000001.front.nv12.zst"]


def test_format_md_snippet_runs(written_root):
    """The FORMAT.md snippet (stdlib + numpy + zstandard + xxhash) run as written."""
    root, written = written_root
    text = (Path(dataset_module.__file__).parent / "FORMAT.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if '["format_version"] == 2' in b)
    ns: dict = {}
    exec(code.replace('root = "out"', f"root = {root!r}"), ns)
    frames, arrays = written[IDS[-1]]  # the last frame of the dataset is episode 30's only frame
    np.testing.assert_array_equal(ns["frame"], frames["front"][0])
    np.testing.assert_array_equal(ns["state"], arrays["state"][0])
    assert ns["e"] == len(IDS) - 1 and ns["t"] == 0


_PROBE = """
import sys, time
t0 = time.perf_counter()
from loongforge.shared.dataset import open_root
ds = open_root(sys.argv[1])
ds.locate(ds.num_frames - 1)
maps = [line.split()[-1] for line in open("/proc/self/maps") if "/index/" in line]
print(sorted(set(maps)))
"""


def test_tables_are_memory_mapped_in_every_process(written_root):
    """Two processes open the same root: both map the table files (shared page cache),
    neither reads them into private memory."""
    root, _ = written_root
    outs = [subprocess.run([sys.executable, "-c", _PROBE, root], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    for out in outs:
        assert out.returncode == 0, out.stderr
        mapped = eval(out.stdout.strip())  # a list literal printed by the probe
        assert {os.path.basename(p) for p in mapped} >= {"blocks.npy", "episode_start.npy", "frame_bucket.npy",
                                                         "first_block.npy"}
    ds = open_root(root)
    assert isinstance(ds.tables["blocks"].base, np.memmap)
    assert np.shares_memory(np.asarray(ds._blocks), ds.tables["blocks"])  # the lookup views are not copies


def test_pickles_by_reopening(written_root):
    """Spawned loader workers receive the dataset pickled: it travels as its root and
    re-maps the tables, never as copies of them."""
    import pickle

    root, written = written_root
    ds = open_root(root)
    blob = pickle.dumps(ds)
    assert len(blob) < 500
    back = pickle.loads(blob)
    np.testing.assert_array_equal(back.read_block(3, "front", 1), written[12][0]["front"][4:8])


def test_read_blocks_all_cameras_in_one_range_read(written_root):
    root, written = written_root
    calls = []

    class Counting(OriginSource):
        def read_range(self, name, offset, length):
            calls.append(length)
            return super().read_range(name, offset, length)

    ds = open_root(root, source=lambda index: Counting(root, index))
    got = ds.read_blocks(2, 3)
    assert len(calls) == 1 and sorted(got) == ["front", "wrist"]
    for cam in got:
        np.testing.assert_array_equal(got[cam], written[8][0][cam][12:16])
    assert list(ds.read_blocks(2, 3, ["wrist"])) == ["wrist"]
    name, off, length, _, _ = ds.block_entry(2, "front", 3)
    _flip(os.path.join(root, name), off + 1)
    with pytest.raises(IntegrityError, match="camera front block 3"):
        open_root(root).read_blocks(2, 3)


def test_empty_root_opens(tmp_path):
    root = str(tmp_path / "empty")
    make_synthetic_root(root, lengths=())
    ds = open_root(root)
    assert ds.num_episodes == 0 == ds.num_frames
    with pytest.raises(IndexError):
        ds.locate(0)


def test_writer_publishes_index_last(tmp_path):
    """A writer that dies mid-way leaves shards but no index.json: the root reads as unfinished."""
    from loongforge.shared.synthetic import synthetic_dataset_info, synthetic_episode
    from loongforge.shared.writer import RootWriter

    root = str(tmp_path / "partial")
    info = synthetic_dataset_info(16, 16, ("front",), 3, 2)
    with pytest.raises(RuntimeError):
        with RootWriter(root, info, block_size=4, shard_size=4096) as w:
            for ep in range(3):
                w.add_episode(ep, *synthetic_episode(ep, 40, 16, 16, ("front",), 3, 2))
            raise RuntimeError("killed")
    assert os.path.isdir(os.path.join(root, "shards")) and not os.path.exists(os.path.join(root, "index.json"))
    with pytest.raises(FormatError, match="did not finish"):
        open_root(root)
