import pytest

from loongforge.shared.errors import ConfigError
from loongforge.shared.units import format_size, parse_size


@pytest.mark.parametrize("text,want", [("2GiB", 2 << 30), ("500MB", 500 * 10**6), ("1.5KiB", 1536),
                                       ("64 MiB", 64 << 20), ("1tb", 10**12), ("4096", 4096), (0, 0)])
def test_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "MB", "12XB", "-1MB", True, -5, "1e3MB"])
def test_parse_rejects_with_field_name(bad):
    with pytest.raises(ConfigError, match="--ram-budget"):
        parse_size(bad, "--ram-budget")


def test_format_round_numbers():
    assert format_size(2 << 30) == "2.0GiB" and format_size(1536) == "1.5KiB" and format_size(12) == "12B"
