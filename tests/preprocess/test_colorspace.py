"""Colour range and matrix per stream: a real full-range clip (re-encoded with
PyAV as yuvj420p, what phone and webcam recorders write) is recorded as full,
cameras that disagree are refused unless --color-range says what to convert to."""

from pathlib import Path

import av
import numpy as np
import pytest

from loongforge.preprocess.stages.colorspace import StreamColor, resolve_colors
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import ConfigError


def reencode_full_range(path: Path) -> None:
    """Decode a limited-range H.264 clip and write it back as full range
    (yuvj420p, color_range=JPEG): same pictures, expanded sample values."""
    with av.open(str(path)) as src:
        stream = src.streams.video[0]
        rate, frames = stream.average_rate, list(src.decode(stream))
    tmp = path.with_suffix(".full.mp4")
    with av.open(str(tmp), "w") as out:
        enc = out.add_stream("libx264", rate=rate)
        enc.width, enc.height, enc.pix_fmt = frames[0].width, frames[0].height, "yuvj420p"
        enc.options = {"crf": "18", "g": "4"}
        for frame in frames:
            full = frame.reformat(format="yuvj420p", src_color_range="MPEG", dst_color_range="JPEG")
            full.pts = None
            for packet in enc.encode(full):
                out.mux(packet)
        for packet in enc.encode():
            out.mux(packet)
    tmp.replace(path)


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory) -> str:
    """2 episodes x 2 cameras; ego_view re-encoded full range, wrist_view left limited."""
    root = generate_dataset(tmp_path_factory.mktemp("color") / "ds", episodes=2, frames=(10, 12), height=32,
                            width=32, gop=4)
    for mp4 in sorted(root.rglob("observation.images.ego_view/*.mp4")):
        reencode_full_range(mp4)
    return str(root)


def _ego(root: str, episode: int = 0) -> str:
    return str(next(Path(root).rglob(f"observation.images.ego_view/episode_{episode:06d}.mp4")))


def _rows(root: str, episode: int = 0) -> int:
    with av.open(_ego(root, episode)) as c:
        return sum(1 for _ in c.decode(video=0))


def test_full_range_clip_is_detected_and_kept(mixed_dataset):
    path = _ego(mixed_dataset)
    with av.open(path) as c:
        y_src = np.stack([f.to_ndarray()[:32] for f in c.decode(video=0)])  # yuvj420p luma, as decoded
    nv12, info = decode_nv12(path, _rows(mixed_dataset))
    assert info.color_range == "full" and info.pix_fmt == "yuvj420p"
    np.testing.assert_array_equal(nv12[:, :32], y_src)  # no silent range squeeze
    assert y_src.min() < 16 or y_src.max() > 235  # really full range content


def test_full_range_clip_keeps_its_range_when_scaled(mixed_dataset):
    path = _ego(mixed_dataset)
    with av.open(path) as c:
        first = next(c.decode(video=0))
        want = first.reformat(width=16, height=16, format="nv12", src_color_range="JPEG",
                              dst_color_range="JPEG").to_ndarray()
    nv12, _ = decode_nv12(path, _rows(mixed_dataset), height=16, width=16)
    np.testing.assert_array_equal(nv12[0], want)


def test_disagreeing_cameras_are_refused(mixed_dataset, tmp_path, run_in_memory):
    with pytest.raises(ConfigError, match=r"disagree on colour range .*ego_view full.*wrist_view limited.*"
                                          r"--color-range"):
        run_in_memory(mixed_dataset, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "index.json").exists()


def test_color_range_flag_converts_every_stream(mixed_dataset, tmp_path, run_in_memory):
    out = str(tmp_path / "out")
    summary = run_in_memory(mixed_dataset, out, color_range="limited")  # the default format: 2
    assert summary["failed"] == 0
    root = open_root(out)
    ds = root.info
    assert (ds.color_range, ds.color_matrix) == ("limited", "bt601")
    assert ds.source["color"]["observation.images.ego_view"]["range"] == ["full"]
    assert ds.source["color"]["observation.images.wrist_view"]["range"] == ["limited"]
    first = root.read_block(0, "ego_view", 0)[0, :32].astype(np.float64)
    with av.open(_ego(mixed_dataset)) as c:
        full = next(c.decode(video=0)).to_ndarray()[:32].astype(np.float64)
    np.testing.assert_allclose(first, 16 + full * 219 / 255, atol=1.5)  # full -> limited, per pixel


def test_all_full_range_dataset_records_full(tmp_path, run_in_memory):
    root = generate_dataset(tmp_path / "ds", episodes=1, frames=(8, 8), height=32, width=32, cameras=("front",), gop=4)
    reencode_full_range(next(root.rglob("*.mp4")))
    out = str(tmp_path / "out")
    run_in_memory(str(root), out)
    assert open_root(out).info.color_range == "full"


def test_resolve_colors_policy():
    full, lim = StreamColor("bt601", "full"), StreamColor("bt709", "limited")
    assert resolve_colors({"a": full, "b": full}).range == "full"
    with pytest.raises(ConfigError, match="--color-matrix"):
        resolve_colors({"a": full, "b": lim}, color_range="full")
    target = resolve_colors({"a": full, "b": lim}, color_range="full", color_matrix="bt709")
    assert (target.matrix, target.range, target.convert) == ("bt709", "full", True)
    assert resolve_colors({}).range == "limited"  # nothing readable: the untagged default
