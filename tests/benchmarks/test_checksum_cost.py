"""benchmarks/micro/checksum_cost.py: the per-block xxh3 check measured over every block of a root."""

import pytest

from loongforge.benchmarks.cli import main as bench
from loongforge.benchmarks.harness.dataset import make_synthetic_root, open_root
from loongforge.benchmarks.micro.checksum_cost import block_checks


def test_a_root_is_measured_per_block(tmp_path, capsys):
    root = str(tmp_path / "root")
    make_synthetic_root(root, lengths=(9, 17), block_size=4)
    got = block_checks(root, rounds=1)
    assert got["blocks"] == (3 + 5) * 2 and got["frames"] == (9 + 17) * 2  # every block of both cameras
    assert got["checked_frames_per_cpu_s"] > 0 and got["xxh3_over_zstd"] > 0
    assert bench(["checksum-cost", root, "--rounds", "1"]) == 0
    assert capsys.readouterr().out.startswith("16 blocks")


def test_a_flipped_block_byte_is_refused(tmp_path):
    root = tmp_path / "root"
    make_synthetic_root(str(root), lengths=(8,), block_size=4, cameras=("front",))
    name, off, length, _, _ = open_root(str(root)).block_entry(0, "front", 1)
    shard = root / name
    data = bytearray(shard.read_bytes())
    data[off + length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="checksum"):
        block_checks(str(root), rounds=1)
