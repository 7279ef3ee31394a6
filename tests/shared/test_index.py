"""The manifest (`index.json`, shared/index.py): deterministic bytes, validation, the shard-level
index, and the files it publishes."""

import json
import os

import pytest

from loongforge.shared import paths
from loongforge.shared.dataset import load_shard_index, open_root
from loongforge.shared.errors import FormatError, IntegrityError, UnsafePathError
from loongforge.shared.index import parse_manifest, shard_level_index
from loongforge.shared.synthetic import make_synthetic_root
from tests.conftest import SYNTHETIC_LENGTHS


def test_manifest_is_byte_stable_and_parses_back(synthetic_root, tmp_path):
    root, index = synthetic_root
    again = str(tmp_path / "again")
    make_synthetic_root(again, lengths=SYNTHETIC_LENGTHS, shard_size=1)
    raw = open(os.path.join(root, "index.json"), "rb").read()
    assert raw == open(os.path.join(again, "index.json"), "rb").read()  # same input, same bytes
    assert shard_level_index(parse_manifest(raw)) == index and len(index.shards) == 4
    assert index.to_json() == load_shard_index(again).to_json()  # the cache daemon's key space per dataset
    assert b"split" not in raw  # unsplit roots carry no split key


def test_missing_and_malformed_index(tmp_path):
    with pytest.raises(FormatError, match="loongforge preprocess"):
        open_root(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "loongforge-shards", "format_version": 2')
    with pytest.raises(FormatError, match="not valid JSON"):
        open_root(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "loongforge-shards", "format_version": 2}')
    with pytest.raises(FormatError, match="malformed"):
        open_root(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "something-else"}')
    with pytest.raises(FormatError, match="not a LoongForge shard index"):
        load_shard_index(str(tmp_path))


def test_unknown_keys_warn(synthetic_root, caplog):
    root, _ = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    doc["future_field"] = 1
    parse_manifest(json.dumps(doc))
    assert "future_field" in caplog.text


@pytest.mark.parametrize("bad", ["../outside.tar", "/abs/shard.tar", "shards/../../x.tar", "shards//x.tar", "a\\b.tar"])
def test_traversal_shard_names_rejected(synthetic_root, bad):
    root, index = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    doc["shards"][0]["name"] = bad
    with pytest.raises(UnsafePathError):
        parse_manifest(json.dumps(doc))
    with pytest.raises(UnsafePathError):
        paths.join(root, bad)
    with pytest.raises(UnsafePathError):
        index.shard(bad)  # a name asked for by a client is checked before the lookup fails
    with pytest.raises(KeyError, match="not in the index"):
        index.shard("shards/shard-999999.tar")


def test_published_files_are_world_readable(synthetic_root):
    root, index = synthetic_root
    for name in ("index.json", index.shards[0].name, "index/blocks.npy"):
        assert os.stat(os.path.join(root, name)).st_mode & 0o044 == 0o044


def test_verify_checks_every_shard_and_table(synthetic_root):
    root, index = synthetic_root
    assert open_root(root).verify() == []
    shard = os.path.join(root, index.shards[1].name)
    data = bytearray(open(shard, "rb").read())
    data[600] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    table = os.path.join(root, "index", "episode_id.npy")
    raw = bytearray(open(table, "rb").read())
    raw[-1] ^= 0x01  # same dtype and shape: only the sha256 tells
    open(table, "wb").write(bytes(raw))
    ds = open_root(root)
    bad = ds.verify()
    assert len(bad) == 2 and bad[0].startswith(index.shards[1].name) and "index/episode_id.npy" in bad[1]
    with pytest.raises(IntegrityError, match="sha256"):
        ds.source.read_shard(index.shards[1].name)
