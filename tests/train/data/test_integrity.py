"""Checksums (xxh3) on the loader's range reads: a flipped byte in an episode's arrays is a bad
sample for every sample of that episode (the configured policy), never a valid one with garbage
values. (A flipped byte in a frame block: test_loader.py.)"""

import io
import os
import tarfile

import numpy as np
import pytest

from loongforge.shared.dataset import open_root
from loongforge.shared.errors import DataWorkerError
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.data.loader import BlockLoader


def flip_state_byte(root: str, episode: int) -> None:
    """Turn state[0, 0] of one episode into +inf (one byte of its float32 changes in the
    exponent: 0x7f -> exponent all ones). The tar stays well-formed, so only a checksum can tell."""
    ds = open_root(root)
    off, length, _ = ds.tables["episode_arrays"][episode].tolist()
    path = os.path.join(root, ds.block_entry(episode, 0, 0)[0])
    data = bytearray(open(path, "rb").read())
    with tarfile.open(fileobj=io.BytesIO(bytes(data[off:off + length]))) as tar:
        member = next(m for m in tar if m.name.endswith(".state.npy"))
    npy = off + member.offset_data
    first = npy + 10 + int.from_bytes(data[npy + 8:npy + 10], "little")  # first float32 of the array
    data[first:first + 4] = np.array([np.inf], np.float32).tobytes()
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("workers", [0, 1])
def test_flipped_state_byte_is_a_bad_sample(tmp_path, caplog, workers):
    root = str(tmp_path)
    make_synthetic_root(root, lengths=(4, 4), block_size=4)
    flip_state_byte(root, 1)  # samples 4..7
    with BlockLoader(root, batch_size=8, max_steps=1, num_workers=workers) as loader:
        batch = next(iter(loader))
        assert loader.bad_samples == 4
    assert "IntegrityError" in caplog.text and "xxh3" in caplog.text
    ids = batch["sample_ids"].tolist()
    for row, gid in enumerate(ids):
        bad = gid >= 4
        assert bool(batch["sample_valid"][row]) is not bad and bool(batch["frame_mask"][row].any()) is not bad
    assert np.isfinite(batch["state"].numpy()).all()  # the masked rows are zeros, not inf
    with BlockLoader(root, batch_size=8, max_steps=1, num_workers=workers, bad_samples="raise") as loader:
        with pytest.raises(DataWorkerError, match=r"sample [4-7] \(episode 1, t \d\).*xxh3"):
            next(iter(loader))
