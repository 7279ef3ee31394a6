"""The shards are webdataset-compatible, as FORMAT.md claims: webdataset's own
reader yields every sample the index lists, in order, with the same members,
and the README's snippet for webdataset users runs as written."""

import re
from pathlib import Path

import numpy as np
import pytest

from loongforge.shared.format import SampleParts
from loongforge.shared.reader import ShardReader

wds = pytest.importorskip("webdataset")  # a declared dependency of the train extra


def test_webdataset_yields_the_index_members(synthetic_root):
    root, index = synthetic_root
    source = ShardReader(root).source
    for entry in index.shards:
        got = list(wds.WebDataset(f"{root}/{entry.name}", shardshuffle=False))
        assert [s["__key__"] for s in got] == list(entry.keys)
        for local, sample in enumerate(got):
            parts = SampleParts(source.read_range(entry.name, entry.offsets[local], entry.lengths[local]))
            members = {k: v for k, v in sample.items() if not k.startswith("__")}
            assert sorted(members) == sorted(parts.members)
            assert all(members[ext] == bytes(parts.members[ext]) for ext in members)


def test_readme_webdataset_snippet_runs(synthetic_root):
    root, index = synthetic_root
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "wds.WebDataset" in b)
    ns: dict = {}
    exec(code.replace('root = "/data/shards"', f"root = {root!r}"), ns)
    samples = list(ns["dataset"])
    reader = ShardReader(root)
    assert [s["key"] for s in samples] == [k for e in index.shards for k in e.keys]
    for n in (0, 13, len(samples) - 1):
        want = reader[n]
        assert samples[n]["task"] == want.task
        np.testing.assert_array_equal(samples[n]["state"], want.state)
        for slot, frames in want.frames.items():
            np.testing.assert_array_equal(samples[n]["frames"][slot], frames)


def test_webdataset_groups_v2_members_as_format_md_says(tmp_path):
    """Format 2: webdataset sees an episode's arrays as one record and each block (every
    camera) as one record, bytes equal to what the index points at."""
    from loongforge.shared.dataset_v2 import open_v2
    from loongforge.shared.synthetic_v2 import make_synthetic_v2_root

    root = str(tmp_path / "v2")
    make_synthetic_v2_root(root, lengths=(9, 5), block_size=4)
    ds = open_v2(root)
    shard = ds.manifest["shards"][0]["name"]
    got = list(wds.WebDataset(f"{root}/{shard}", shardshuffle=False))
    assert [r["__key__"] for r in got] == ["e000000", "e000000_b000000", "e000000_b000001", "e000000_b000002",
                                          "e000001", "e000001_b000000", "e000001_b000001"]
    assert sorted(k for k in got[0] if not k.startswith("__")) == [
        "action.npy", "frame_index.npy", "state.npy", "task_index.npy", "timestamp.npy"]
    _, off, length, _, _ = ds.block_entry(0, "wrist", 2)
    assert got[3]["wrist.nv12.zst"] == bytes(ds.source.read_range(shard, off, length))
