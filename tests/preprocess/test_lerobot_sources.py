"""LeRobot v2.0 / v2.1 / v3.0 sources through the real job, read back frame by frame.

The v3.0 fixtures (../shared/fixtures/lerobot_v3) were written by LeRobot 0.6.1 itself: AV1 with
a keyframe every 2 frames, 4 episodes concatenated per camera, cameras of two sizes, and the
same episodes as PNG image features. Every frame of every episode read back from the shards must
equal PyAV's own decode of that frame (NV12, bit-exact) or, for image features, the PNG's pixels
converted by the documented rule (preprocess/stages/images.py); every state/action row, length and task
string exactly what the parquet holds."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from loongforge.cli import main
from loongforge.preprocess.stages.decode import decode_nv12
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.samples.dataset import generate_dataset
from loongforge.preprocess.samples.layouts import write_v3, write_v21
from loongforge.shared import color
from loongforge.shared.dataset import open_root
from tests.outside import copy_fixture
from tests.preprocess.conftest import SMALL


@pytest.fixture(scope="module")
def v3_fixture(tmp_path_factory, run_in_memory):
    """kind -> (source copy, shard root) for both fixture datasets, each preprocessed once."""
    out = {}
    tmp = tmp_path_factory.mktemp("lerobot_v3")
    for kind in ("video", "image"):
        src = copy_fixture(f"lerobot_v3/{kind}", tmp / kind)
        run_in_memory(str(src), str(tmp / f"{kind}_shards"), block_frames=8)
        out[kind] = (src, str(tmp / f"{kind}_shards"))
    return out


def _episode_rows(src: Path, ep: int):
    data = pq.read_table(src / "data/chunk-000/file-000.parquet")
    return data.filter(pc.equal(data.column("episode_index"), ep))


def _all_frames(ds, e: int, slot: str) -> np.ndarray:
    return np.concatenate([ds.read_block(e, slot, b) for b in range(ds.num_blocks(e))])


def _check_rows_and_tasks(src: Path, ds) -> list[dict]:
    meta_eps = pq.read_table(src / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    tasks = pq.read_table(src / "meta/tasks.parquet").to_pylist()
    assert ds.num_episodes == len(meta_eps) == 4 and ds.num_frames == 195
    assert ds.info.tasks == {str(t["task_index"]): t["task"] for t in tasks}
    for e in range(ds.num_episodes):
        m = meta_eps[ds.episode_id(e)]
        rows, arrays = _episode_rows(src, m["episode_index"]), ds.read_arrays(e)
        assert int(ds.episode_lengths[e]) == m["length"] == rows.num_rows
        np.testing.assert_array_equal(arrays["state"], np.array(rows.column("observation.state").to_pylist(),
                                                                np.float32))
        np.testing.assert_array_equal(arrays["action"], np.array(rows.column("action").to_pylist(), np.float32))
        for name in ("frame_index", "index", "task_index"):
            np.testing.assert_array_equal(arrays[name], rows.column(name).to_numpy())
        np.testing.assert_array_equal(arrays["timestamp"].astype(np.float32), rows.column("timestamp").to_numpy())
        assert [ds.info.tasks[str(t)] for t in np.unique(arrays["task_index"])] == m["tasks"]
    return meta_eps


def test_v3_video_every_frame_is_pyavs_decode(v3_fixture):
    import av

    src, root = v3_fixture["video"]
    ds = open_root(root)
    assert ds.verify() == [] and ds.info.source["codebase_version"] == "v3.0"
    meta_eps = _check_rows_and_tasks(src, ds)
    for c, cam in enumerate(ds.info.cameras):
        assert ds.info.camera_size(c) == {"front": (64, 96), "wrist": (48, 48)}[cam.slot]  # each its own size
        with av.open(str(src / f"videos/{cam.key}/chunk-000/file-000.mp4")) as container:
            stream = container.streams.video[0]
            decoded = [(float(f.pts * stream.time_base), f.to_ndarray(format="nv12")) for f in container.decode(stream)]
        times = np.array([t for t, _ in decoded])
        used = []
        for e in range(ds.num_episodes):
            m, arrays = meta_eps[ds.episode_id(e)], ds.read_arrays(e)
            got = _all_frames(ds, e, cam.slot)
            for t in range(len(got)):  # the frame LeRobot shows at episode time ts: from_timestamp + ts
                k = int(np.abs(times - (m[f"videos/{cam.key}/from_timestamp"] + arrays["timestamp"][t])).argmin())
                np.testing.assert_array_equal(got[t], decoded[k][1], err_msg=f"{cam.key} episode {e} frame {t}")
                used.append(k)
        assert used == list(range(len(decoded)))  # first to last frame of each episode, no neighbour's, none twice


def test_v3_image_features_follow_the_documented_rule(v3_fixture):
    from PIL import Image

    src, root = v3_fixture["image"]
    ds = open_root(root)
    _check_rows_and_tasks(src, ds)
    assert (ds.info.color_matrix, ds.info.color_range) == ("bt601", "full")  # images only: JPEG's own YCbCr
    for e in range(ds.num_episodes):
        rows = _episode_rows(src, ds.episode_id(e))
        for cam in ds.info.cameras:
            got = _all_frames(ds, e, cam.slot)
            for t, cell in enumerate(rows.column(cam.key).to_pylist()):
                rgb = np.asarray(Image.open(io.BytesIO(cell["bytes"])).convert("RGB"))
                np.testing.assert_array_equal(got[t], color.rgb_to_nv12(rgb, "bt601", "full"))


def test_v3_metadata_reaches_the_index(v3_fixture):
    src, root = v3_fixture["video"]
    info = open_root(root).info
    assert info.source["lerobot_stats"] == json.loads((src / "meta/stats.json").read_text())
    assert info.source["features"]["observation.images.front"]["dtype"] == "video"
    # No modality.json: groups from info.json's names (q0..q6, a0..a6).
    assert info.modality["state"] == {"q": {"start": 0, "end": 7}} and info.modality["action"] == {
        "a": {"start": 0, "end": 7}}
    assert info.state_names == tuple(f"q{i}" for i in range(7))


@pytest.mark.parametrize("codec", ["h264", "hevc"])
def test_v3_spans_are_frame_exact_for_other_codecs(tmp_path, run_in_memory, codec):
    """LeRobot also writes H.264 and HEVC; two files of 2 + 1 episodes at GOP 2 (HEVC's second
    episode does not start on a keyframe: the seek lands before it and decodes forward)."""
    src = write_v3(generate_dataset(tmp_path / "v2", **SMALL), tmp_path / "v3", codec=codec, gop=2,
                   episodes_per_file=2)
    out = str(tmp_path / "shards")
    run_in_memory(str(src), out, block_frames=4)
    ds = open_root(out)
    meta, episodes = discover(str(src))
    assert meta.codebase_version == "v3.0" and ds.num_episodes == 3
    for e, spec in enumerate(episodes):
        for (key, path), span in zip(spec.videos, spec.spans):
            whole = decode_nv12(path, _count_frames(path))[0]
            first = int(round(span[0] * meta.fps))
            np.testing.assert_array_equal(_all_frames(ds, e, key.split(".")[-1]), whole[first:first + spec.length])


def _count_frames(path: str) -> int:
    import av

    with av.open(path) as c:
        return sum(1 for _ in c.decode(video=0))


def test_a_span_is_reached_by_seeking_not_by_decoding_the_file_from_its_start(v3_fixture, monkeypatch):
    import av

    from loongforge.preprocess.stages import decode

    src, _ = v3_fixture["video"]
    path = str(src / "videos/observation.images.front/chunk-000/file-000.mp4")
    meta_eps = pq.read_table(src / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    last = meta_eps[-1]
    decoded = []
    real_decode = av.container.InputContainer.decode

    def counting(self, *args, **kwargs):
        for frame in real_decode(self, *args, **kwargs):
            decoded.append(frame.pts)
            yield frame

    monkeypatch.setattr(av.container.InputContainer, "decode", counting)
    key = "videos/observation.images.front/"
    span = (last[key + "from_timestamp"], last[key + "to_timestamp"])
    frames, _ = decode.decode_nv12(path, last["length"], span=span)
    assert len(frames) == last["length"] == 52
    assert len(decoded) <= last["length"] + 2  # the keyframe at (or one frame before) the span, then forward


def test_v21_dataset_reads_with_per_episode_stats(tmp_path, run_in_memory):
    src = write_v21(generate_dataset(tmp_path / "v21", **SMALL))
    out = str(tmp_path / "shards")
    run_in_memory(str(src), out, block_frames=4)
    ds = open_root(out)
    assert ds.info.source["codebase_version"] == "v2.1" and ds.num_episodes == 3
    meta, episodes = discover(str(src))
    tables = [pq.read_table(e.parquet) for e in episodes]
    state = np.concatenate([np.array(t.column("observation.state").to_pylist(), np.float64) for t in tables])
    want = ds.info.source["lerobot_stats"]["observation.state"]  # LeRobot's aggregation of episodes_stats
    assert want["count"] == [len(state)]
    np.testing.assert_allclose(want["mean"], state.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(want["std"], state.std(0), rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(want["min"], state.min(0))
    for e, spec in enumerate(episodes):
        for key, path in spec.videos:
            np.testing.assert_array_equal(_all_frames(ds, e, key.split(".")[-1]), decode_nv12(path, spec.length)[0])


@pytest.mark.parametrize("version", ["v1.6", "v4.0", None])
def test_an_unsupported_version_is_refused_before_any_work(tmp_path, capsys, version):
    src = generate_dataset(tmp_path / "ds", episodes=1, frames=(4, 4), cameras=("front",))
    info = json.loads((src / "meta/info.json").read_text())
    if version is None:
        del info["codebase_version"]
    else:
        info["codebase_version"] = version
    (src / "meta/info.json").write_text(json.dumps(info))
    out = tmp_path / "out"
    assert main(["preprocess", "--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "v2.0, v2.1, v3.0" in err and repr(version) in err
    assert not out.exists()
