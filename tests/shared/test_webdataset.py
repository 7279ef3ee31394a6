"""The shards are webdataset-compatible, as FORMAT.md claims: webdataset's own reader sees each
episode's arrays as one record and each block (every camera) as one record, in shard order, with
the bytes the tables point at; the README's snippet for webdataset users runs as written."""

import re
from pathlib import Path

import numpy as np
import pytest

from loongforge.shared.dataset import open_root
from loongforge.shared.members import split_members
from loongforge.shared.synthetic import make_synthetic_root

wds = pytest.importorskip("webdataset")  # a declared dependency of the train extra


@pytest.fixture
def root(tmp_path):
    root = str(tmp_path / "root")
    written = make_synthetic_root(root, lengths=(9, 5, 12), block_size=4, shard_size=1 << 14,
                                  block_codec="delta-zstd")
    return root, written


def test_webdataset_yields_the_members_the_tables_point_at(root):
    root, _ = root
    ds = open_root(root)
    assert len(ds.manifest["shards"]) > 1
    e = 0
    for number, shard in enumerate(ds.manifest["shards"]):
        got = list(wds.WebDataset(f"{root}/{shard['name']}", shardshuffle=False))
        want_keys, pos = [], 0
        while e < ds.num_episodes and int(ds.tables["episode_shard"][e]) == number:
            key = f"e{ds.episode_id(e):06d}"
            rec = got[pos]
            assert rec["__key__"] == key
            off, length, _ = ds.tables["episode_arrays"][e].tolist()
            arrays = split_members(ds.source.read_range(shard["name"], off, length))
            assert {k: rec[k] for k in rec if not k.startswith("__")} == \
                {name.partition(".")[2]: bytes(v) for name, v in arrays.items()}
            for b in range(ds.num_blocks(e)):
                rec = got[pos + 1 + b]
                assert rec["__key__"] == f"{key}_b{b:06d}"
                for cam in ds.cameras:
                    _, boff, blen, _, _ = ds.block_entry(e, cam, b)
                    assert rec[f"{cam}.nv12.zst"] == bytes(ds.source.read_range(shard["name"], boff, blen))
            want_keys += [key] + [f"{key}_b{b:06d}" for b in range(ds.num_blocks(e))]
            pos += 1 + ds.num_blocks(e)
            e += 1
        assert [r["__key__"] for r in got] == want_keys
    assert e == ds.num_episodes


def test_readme_webdataset_snippet_runs(root):
    root, written = root
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "wds.WebDataset" in b)
    ns: dict = {}
    exec(code.replace('root = "/data/shards"', f"root = {root!r}"), ns)
    records = list(ns["dataset"])
    arrays = [r for r in records if "arrays" in r]
    assert [r["key"] for r in arrays] == ["e000000", "e000001", "e000002"]
    for r in arrays:
        frames, want = written[int(r["key"][1:])]
        for name in ("state", "action", "task_index"):
            np.testing.assert_array_equal(r["arrays"][name], want[name])
    for r in records:
        if "frames" in r:
            ep, b = (int(x) for x in re.fullmatch(r"e(\d+)_b(\d+)", r["key"]).groups())
            for slot, got in r["frames"].items():
                np.testing.assert_array_equal(got, written[ep][0][slot][4 * b:4 * b + 4])  # delta-zstd undone
