"""Per-sample checksum (xxh3) on the loader's range reads: a flipped byte in a sample is
a bad sample (the configured policy), never a valid one with garbage values."""

import io
import json
import os
import tarfile

import numpy as np
import pytest

from loongforge.shared.errors import DataWorkerError
from loongforge.shared.index import load_index
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader_v1 import ShardLoader


def flip_state_byte(root: str, shard: int = 1, local: int = 2) -> int:
    """Turn state[0, 0] of one sample into +inf (one byte of its float32 changes
    in the exponent: 0x7f -> exponent all ones). The tar stays well-formed, so
    only a checksum can tell. Returns the global sample number."""
    index = load_index(root)
    entry = index.shards[shard]
    path = os.path.join(root, entry.name)
    data = bytearray(open(path, "rb").read())
    off, length = entry.offsets[local], entry.lengths[local]
    with tarfile.open(fileobj=io.BytesIO(bytes(data[off:off + length]))) as tar:
        member = next(m for m in tar if m.name.endswith(".state.npy"))
    npy = off + member.offset_data
    first = npy + 10 + int.from_bytes(data[npy + 8:npy + 10], "little")  # first float32 of the array
    data[first:first + 4] = np.array([np.inf], np.float32).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return index.shard_start(shard) + local


@pytest.mark.parametrize("workers", [0, 1])
def test_flipped_state_byte_is_a_bad_sample(tmp_path, caplog, workers):
    root = str(tmp_path)
    make_synthetic_root(root, shards=2, samples_per_shard=4)
    bad = flip_state_byte(root)
    with ShardLoader(root, batch_size=8, max_steps=1, num_workers=workers) as loader:
        batch = next(iter(loader))
        assert loader.bad_samples == 1
    assert "IntegrityError" in caplog.text and "xxh3" in caplog.text
    row = batch["sample_ids"].tolist().index(bad)
    assert not batch["sample_valid"][row] and not batch["frame_mask"][row].any()
    assert int(batch["sample_valid"].sum()) == 7
    assert np.isfinite(batch["state"].numpy()).all()  # the masked row is zeros, not inf
    with ShardLoader(root, batch_size=8, max_steps=1, num_workers=workers, bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match=f"sample {bad}.*xxh3"):
            next(iter(loader))


def test_index_without_checksums_still_loads_and_trains(tmp_path):
    """Indexes written before `sample_xxh3` existed: no check, same batches."""
    root = str(tmp_path)
    make_synthetic_root(root, shards=2, samples_per_shard=4)
    with ShardLoader(root, batch_size=8, max_steps=1, num_workers=0, seed=1) as loader:
        want = next(iter(loader))
    path = os.path.join(root, "index.json")
    doc = json.load(open(path))
    del doc["sample_xxh3"]
    open(path, "w").write(json.dumps(doc, sort_keys=True))
    index = load_index(root)
    assert all(s.xxh3 == () for s in index.shards)
    with ShardLoader(root, batch_size=8, max_steps=1, num_workers=0, seed=1) as loader:
        got = next(iter(loader))
    assert bool(got["sample_valid"].all())
    assert (got["state"] == want["state"]).all() and (got["sample_ids"] == want["sample_ids"]).all()
