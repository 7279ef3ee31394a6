import json
import os

import pytest

from loongforge.shared import paths
from loongforge.shared.errors import FormatError, FormatVersionError, IntegrityError, UnsafePathError
from loongforge.shared.index import ShardIndex, load_index
from loongforge.shared.reader import ShardReader


def test_index_round_trip_is_byte_stable(synthetic_root):
    root, index = synthetic_root
    raw = open(os.path.join(root, "index.json"), "rb").read()
    again = ShardIndex.from_json(raw)
    assert again.to_json() == raw
    assert again.num_samples == 32 and len(again.shards) == 4


def test_locate_covers_every_sample(synthetic_root):
    _, index = synthetic_root
    seen = [index.locate(n) for n in range(index.num_samples)]
    assert len(set(seen)) == index.num_samples
    assert seen[0] == (0, 0) and seen[-1] == (3, 7)
    with pytest.raises(IndexError):
        index.locate(index.num_samples)


@pytest.mark.parametrize("version, hint", [(3, "upgrade loongforge"), (2, "open_v2"),
                                           (0, "re-run `loongforge preprocess`")])
def test_unknown_index_version_rejected_with_hint(synthetic_root, version, hint):
    root, _ = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    doc["format_version"] = version
    with pytest.raises(FormatVersionError, match=hint):
        ShardIndex.from_json(json.dumps(doc))


def test_missing_and_malformed_index(tmp_path, synthetic_root):
    with pytest.raises(FormatError, match="loongforge preprocess"):
        load_index(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "loongforge-shards", "format_version": 1')
    with pytest.raises(FormatError, match="not valid JSON"):
        load_index(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "loongforge-shards", "format_version": 1}')
    with pytest.raises(FormatError, match="malformed"):
        load_index(str(tmp_path))


def test_unknown_keys_warn(synthetic_root, caplog):
    root, _ = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    doc["future_field"] = 1
    ShardIndex.from_json(json.dumps(doc))
    assert "future_field" in caplog.text


@pytest.mark.parametrize("bad", ["../outside.tar", "/abs/shard.tar", "shards/../../x.tar", "shards//x.tar", "a\\b.tar"])
def test_traversal_shard_names_rejected(synthetic_root, bad):
    root, _ = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    doc["shards"][0]["name"] = bad
    with pytest.raises(UnsafePathError):
        ShardIndex.from_json(json.dumps(doc))
    with pytest.raises(UnsafePathError):
        paths.join(root, bad)


def test_reader_verifies_hash_and_size(synthetic_root):
    root, index = synthetic_root
    reader = ShardReader(root, verify=True)
    assert [s.key for s in reader] == [k for s in index.shards for k in s.keys]
    path = os.path.join(root, index.shards[1].name)
    data = bytearray(open(path, "rb").read())
    data[600] ^= 0xFF
    open(path, "wb").write(bytes(data))
    bad = ShardReader(root, verify=True)
    with pytest.raises(IntegrityError, match="sha256"):
        bad[index.shard_start(1)]
    assert len(bad.verify()) == 1
    open(path, "wb").write(bytes(data[:1000]))
    with pytest.raises(IntegrityError, match="truncated"):
        ShardReader(root, verify=True)[index.shard_start(1)]
    # Without verification a truncated range is still caught, never read short.
    with pytest.raises(IntegrityError, match="truncated"):
        ShardReader(root)[index.shard_start(1) + 7]


def test_random_access_matches_iteration(synthetic_root):
    root, _ = synthetic_root
    reader = ShardReader(root)
    ordered = list(reader)
    for n in (0, 9, 31):
        assert reader[n].key == ordered[n].key
        assert (reader[n].frames["front"] == ordered[n].frames["front"]).all()


def test_published_files_are_world_readable(synthetic_root):
    root, index = synthetic_root
    for name in ("index.json", index.shards[0].name):
        assert os.stat(os.path.join(root, name)).st_mode & 0o044 == 0o044


def _flip_payload_byte(root, entry, local):
    path = os.path.join(root, entry.name)
    data = bytearray(open(path, "rb").read())
    data[entry.offsets[local] + 512 + 3] ^= 0x01  # inside the first member's data (meta.json stays JSON)
    open(path, "wb").write(bytes(data))


def test_every_sample_has_a_checksum_and_range_reads_check_it(synthetic_root):
    import xxhash

    root, index = synthetic_root
    raw = open(os.path.join(root, index.shards[0].name), "rb").read()
    e = index.shards[0]
    assert [xxhash.xxh3_64_hexdigest(raw[o:o + n]) for o, n in zip(e.offsets, e.lengths)] == list(e.xxh3)
    assert ShardIndex.from_json(index.to_json()).shards[0].xxh3 == e.xxh3
    _flip_payload_byte(root, index.shards[2], 5)
    reader = ShardReader(root)  # no whole-shard verification: only the range is read
    reader[index.shard_start(2) + 4]  # neighbours still read
    with pytest.raises(IntegrityError, match="xxh3"):
        reader[index.shard_start(2) + 5]
    with pytest.raises(IntegrityError, match="xxh3"):
        list(reader)


def test_index_without_checksums_loads_and_reads(synthetic_root, caplog):
    root, index = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    del doc["sample_xxh3"]
    old = ShardIndex.from_json(json.dumps(doc))
    assert "ignoring unknown key" not in caplog.text
    assert all(s.xxh3 == () for s in old.shards)
    assert "sample_xxh3" not in json.loads(old.to_json())
    assert ShardReader(root, index=old)[3].key == index.shards[0].keys[3]


def test_checksum_count_must_match_samples(synthetic_root):
    root, _ = synthetic_root
    doc = json.load(open(os.path.join(root, "index.json")))
    name = doc["shards"][0]["name"]
    doc["sample_xxh3"][name] = doc["sample_xxh3"][name][:-1]
    with pytest.raises(FormatError, match="checksums"):
        ShardIndex.from_json(json.dumps(doc))


def test_locate_does_not_rescan_shards(synthetic_root, monkeypatch):
    """num_samples (and totals) are computed once: locate runs per sample read."""
    from loongforge.shared.index import ShardEntry

    root, _ = synthetic_root
    index = load_index(root)
    calls = {"n": 0}
    original = ShardEntry.samples

    def counting(self):
        calls["n"] += 1
        return original.fget(self)

    monkeypatch.setattr(ShardEntry, "samples", property(counting))
    index.locate(0)
    index.summary()
    first = calls["n"]
    for n in range(index.num_samples):
        index.locate(n)
        index.summary()
    assert calls["n"] == first
