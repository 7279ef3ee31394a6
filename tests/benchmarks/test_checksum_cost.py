"""benchmarks/micro/checksum_cost.py reads format-2 roots (per-block xxh3) as well as format 1."""

import pytest

from loongforge.benchmarks.micro.checksum_cost import block_checks, main
from loongforge.shared.synthetic_v2 import make_synthetic_v2_root


def test_format_2_root_is_measured_per_block(tmp_path, capsys):
    root = str(tmp_path / "v2")
    make_synthetic_v2_root(root, lengths=(9, 17), block_size=4)
    got = block_checks(root, rounds=1)
    assert got["blocks"] == (3 + 5) * 2 and got["frames"] == (9 + 17) * 2  # every block of both cameras
    assert got["checked_frames_per_cpu_s"] > 0 and got["xxh3_over_zstd"] > 0
    main([root, "--rounds", "1"])
    assert capsys.readouterr().out.startswith("format 2, 16 blocks")


def test_a_flipped_block_byte_is_refused(tmp_path):
    from loongforge.shared.dataset_v2 import open_v2

    root = tmp_path / "v2"
    make_synthetic_v2_root(str(root), lengths=(8,), block_size=4, cameras=("front",))
    name, off, length, _, _ = open_v2(str(root)).block_entry(0, "front", 1)
    shard = root / name
    data = bytearray(shard.read_bytes())
    data[off + length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="checksum"):
        block_checks(str(root), rounds=1)
