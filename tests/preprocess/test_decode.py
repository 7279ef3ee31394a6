"""NV12 fidelity of the decode stage against PyAV's own conversions of the
same real H.264 frames, and its handling of bad video."""

from pathlib import Path

import av
import numpy as np
import pytest

from loongforge.preprocess.stages.decode import crop_box, decode_nv12
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.shared import color
from loongforge.shared.errors import SourceDataError


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> tuple[str, list]:
    root = generate_dataset(tmp_path_factory.mktemp("v") / "ds", episodes=1, frames=(16, 16), height=64, width=96,
                            cameras=("cam",), gop=5)
    path = str(next(Path(root).rglob("*.mp4")))
    with av.open(path) as c:
        frames = list(c.decode(video=0))
    return path, frames


def _planes(frame):
    y, u, v = (np.frombuffer(p, np.uint8).reshape(p.height, p.line_size)[:, : p.width] for p in frame.planes)
    return y, u, v


def test_source_resolution_is_a_lossless_repack(video):
    path, frames = video
    nv12, info = decode_nv12(path, len(frames))
    assert nv12.shape == (16, 96, 96) and (info.height, info.width, info.codec) == (64, 96, "h264")
    assert info.color_matrix == "bt601"
    y, u, v = color.split_planes(nv12)
    for i, frame in enumerate(frames):
        assert frame.format.name == "yuv420p"
        py, pu, pv = _planes(frame)
        assert np.array_equal(y[i], py) and np.array_equal(u[i], pu) and np.array_equal(v[i], pv)


def test_resize_matches_pyav_resize(video):
    path, frames = video
    nv12, _ = decode_nv12(path, len(frames), height=32, width=48)
    assert nv12.shape == (16, 48, 48)
    for i, frame in enumerate(frames):
        ref = frame.reformat(width=48, height=32, format="nv12").to_ndarray()
        assert psnr(nv12[i, :32], ref[:32]) >= 40.0


def test_crop_takes_the_centre_then_scales(video):
    path, frames = video
    assert crop_box(64, 96, 64, 64) == (0, 16, 64, 64)
    nv12, _ = decode_nv12(path, len(frames), height=64, width=64, resize_mode="crop")  # crop only, no scaling
    y, u, v = color.split_planes(nv12)
    py, pu, pv = _planes(frames[3])
    assert np.array_equal(y[3], py[:, 16:80]) and np.array_equal(u[3], pu[:, 8:40]) and np.array_equal(v[3], pv[:, 8:40])
    small, _ = decode_nv12(path, len(frames), height=32, width=32, resize_mode="crop")
    ref = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[3].to_ndarray(format="rgb24")[:, 16:80]),
                                     format="rgb24").reformat(width=32, height=32, format="gray")
    assert psnr(small[3, :32], ref.to_ndarray()) >= 30.0  # same content (gray path rounds differently)


def test_nv12_to_rgb_matches_pyav_rgb(video):
    path, frames = video
    nv12, info = decode_nv12(path, len(frames))
    rgb = color.nv12_to_rgb(nv12, info.color_matrix, "limited")
    for i, frame in enumerate(frames):
        assert psnr(rgb[i], frame.to_ndarray(format="rgb24")) >= 35.0


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("rgb", [(255, 0, 0), (0, 255, 0), (0, 0, 255), (128, 128, 128), (0, 0, 0), (255, 255, 255)])
def test_known_colours_round_trip(rgb, matrix):
    img = np.broadcast_to(np.array(rgb, np.uint8), (4, 6, 3)).copy()
    back = color.nv12_to_rgb(color.rgb_to_nv12(img, matrix, "limited"), matrix, "limited")
    assert np.abs(back.astype(int) - img).max() <= 2


def test_missing_corrupt_and_mismatched_video(tmp_path, video):
    path, frames = video
    with pytest.raises(SourceDataError, match="missing"):
        decode_nv12(str(tmp_path / "nope.mp4"), 4)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(Path(path).read_bytes()[:3000])
    with pytest.raises(SourceDataError, match="unreadable|mismatch"):
        decode_nv12(str(bad), len(frames))
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00\x01not an mp4" * 100)
    with pytest.raises(SourceDataError, match="unreadable"):
        decode_nv12(str(garbage), 4)
    with pytest.raises(SourceDataError, match="length mismatch.*parquet 20 rows"):
        decode_nv12(path, 20)
    with pytest.raises(SourceDataError, match="length mismatch.*parquet 10 rows"):
        decode_nv12(path, 10)


def test_bt709_tagged_stream_is_recorded(tmp_path):
    import io

    rgb = np.zeros((4, 32, 32, 3), np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=20)
        s.width = s.height = 32
        s.pix_fmt = "yuv420p"
        s.codec_context.colorspace = 1  # BT.709
        for i in range(4):
            f = av.VideoFrame.from_ndarray(rgb[i], format="rgb24").reformat(format="yuv420p")
            f.pts = i
            c.mux(s.encode(f))
        c.mux(s.encode())
    path = tmp_path / "709.mp4"
    path.write_bytes(buf.getvalue())
    _, info = decode_nv12(str(path), 4)
    assert info.color_matrix == "bt709"
