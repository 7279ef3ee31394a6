import numpy as np
import pytest

from loongforge.shared import color
from loongforge.shared.errors import FormatError

KNOWN = {
    "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255),
    "white": (255, 255, 255), "black": (0, 0, 0), "grey": (128, 128, 128), "orange": (255, 128, 0),
}
# BT.601 limited-range code values of pure colours (the textbook table).
BT601_LIMITED = {"red": (81, 90, 240), "green": (145, 54, 34), "blue": (41, 240, 110),
                 "white": (235, 128, 128), "black": (16, 128, 128)}


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("rng_", ["limited", "full"])
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_colours_round_trip(matrix, rng_, name):
    rgb = np.zeros((4, 6, 3), np.uint8) + np.array(KNOWN[name], np.uint8)
    nv12 = color.rgb_to_nv12(rgb, matrix, rng_)
    assert nv12.shape == (6, 6)
    back = color.nv12_to_rgb(nv12, matrix, rng_)
    assert np.abs(back.astype(int) - rgb.astype(int)).max() <= 2


@pytest.mark.parametrize("name", sorted(BT601_LIMITED))
def test_bt601_limited_matches_reference_table(name):
    y, cb, cr = BT601_LIMITED[name]
    nv12 = np.empty((3, 2), np.uint8)
    nv12[:2] = y
    nv12[2] = (cb, cr)
    rgb = color.nv12_to_rgb(nv12, "bt601", "limited")
    assert np.abs(rgb.astype(int) - np.array(KNOWN[name])).max() <= 2


def test_matrices_differ_and_bad_names_rejected():
    nv12 = np.array([[81, 81], [81, 81], [90, 240]], np.uint8)
    assert not np.array_equal(color.nv12_to_rgb(nv12, "bt601"), color.nv12_to_rgb(nv12, "bt709"))
    with pytest.raises(FormatError):
        color.nv12_to_rgb(nv12, "bt2020")
    with pytest.raises(FormatError):
        color.nv12_to_rgb(nv12, "bt601", "studio")
    with pytest.raises(FormatError):
        color.split_planes(np.zeros((5, 4), np.uint8))


def test_batched_frames():
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (3, 2, 8, 10, 3), dtype=np.uint8)
    nv12 = color.rgb_to_nv12(rgb)
    assert nv12.shape == (3, 2, 12, 10)
    assert color.nv12_to_rgb(nv12).shape == rgb.shape
