"""The generator writes what real LeRobot v2.0 / GR00T datasets hold: real
H.264 with moving content, the meta files, and (on request) their defects."""

import hashlib
import json
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest

from loongforge.preprocess.samples.dataset import PRESETS, QUIRKS, generate_dataset, generate_preset, hand_dims
from loongforge.preprocess.samples.learnable import HAND_LEVELS, hands_episode
from loongforge.shared.errors import ConfigError


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return h.hexdigest()


def _decode(path: Path) -> tuple[list[np.ndarray], av.video.stream.VideoStream, int]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        frames, keys = [], 0
        for f in c.decode(s):
            frames.append(f.to_ndarray(format="rgb24"))
            keys += f.key_frame
        return frames, (s.codec_context.name, s.codec_context.pix_fmt, s.average_rate), keys


def test_layout_meta_and_parquet(sample_dataset):
    root = Path(sample_dataset)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v2.0" and info["total_episodes"] == 3 and info["total_chunks"] == 1
    assert info["splits"] == {"train": "0:3"}
    cams = [k for k, v in info["features"].items() if v["dtype"] == "video"]
    assert cams == ["observation.images.ego_view", "observation.images.wrist_view"]
    assert info["features"]["observation.images.ego_view"]["shape"] == [64, 64, 3]
    assert len(info["features"]["observation.state"]["names"]) == 8
    episodes = [json.loads(line) for line in (root / "meta/episodes.jsonl").read_text().splitlines()]
    tasks = {json.loads(line)["task_index"]: json.loads(line)["task"]
             for line in (root / "meta/tasks.jsonl").read_text().splitlines()}
    modality = json.loads((root / "meta/modality.json").read_text())
    assert modality["state"]["gripper"] == {"start": 7, "end": 8}
    assert modality["video"]["ego_view"] == {"original_key": "observation.images.ego_view"}
    assert sum(e["length"] for e in episodes) == info["total_frames"]
    assert len({e["length"] for e in episodes}) > 1  # lengths vary per episode
    for ep in episodes:
        i = ep["episode_index"]
        table = pq.read_table(root / info["data_path"].format(episode_chunk=0, episode_index=i))
        assert table.num_rows == ep["length"]
        for col in ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index",
                    "task_index", "annotation.human.action.task_description"):
            assert col in table.column_names
        assert tasks[table.column("task_index")[0].as_py()] == ep["tasks"][0]
        state = np.array(table.column("observation.state").to_pylist(), dtype=np.float32)
        assert state.shape == (ep["length"], 8) and state.std() > 0.1


def test_videos_are_real_h264_with_moving_content(sample_dataset):
    root = Path(sample_dataset)
    info = json.loads((root / "meta/info.json").read_text())
    length = json.loads((root / "meta/episodes.jsonl").read_text().splitlines()[0])["length"]
    path = root / info["video_path"].format(episode_chunk=0, video_key="observation.images.wrist_view",
                                            episode_index=0)
    frames, (codec, pix_fmt, rate), keys = _decode(path)
    assert (codec, pix_fmt, rate) == ("h264", "yuv420p", 20)
    assert len(frames) == length and frames[0].shape == (64, 64, 3)
    assert keys == -(-length // 6)  # gop=6
    assert frames[0].std() > 20  # not a flat colour
    diffs = [np.abs(a.astype(int) - b).mean() for a, b in zip(frames, frames[1:])]
    assert min(diffs) > 1.0  # every frame moves


def test_generation_is_deterministic(tmp_path):
    a = generate_dataset(tmp_path / "a", episodes=2, frames=(10, 12), seed=5)
    b = generate_dataset(tmp_path / "b", episodes=2, frames=(10, 12), seed=5)
    c = generate_dataset(tmp_path / "c", episodes=2, frames=(10, 12), seed=6)
    assert _tree_hash(a) == _tree_hash(b) != _tree_hash(c)


def test_long_gop(tmp_path):
    root = generate_dataset(tmp_path / "g", episodes=1, frames=(120, 120), cameras=("cam",), gop=100)
    frames, _, keys = _decode(next(root.rglob("*.mp4")))
    assert len(frames) == 120 and keys == 2


def test_quirks(tmp_path):
    root = generate_dataset(tmp_path / "q", episodes=3, frames=(12, 16), quirks=QUIRKS)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["total_chunks"] == 0 and info["splits"]["train"] == "0:103"
    assert "observation.images.side_view" in info["features"]
    assert not list(root.rglob("*side_view*"))  # listed, no files
    lengths = [json.loads(line)["length"] for line in (root / "meta/episodes.jsonl").read_text().splitlines()]
    bad = root / "videos/chunk-000/observation.images.ego_view/episode_000001.mp4"
    with pytest.raises(av.FFmpegError):
        _decode(bad)
    short = root / "videos/chunk-000/observation.images.ego_view/episode_000002.mp4"
    assert len(_decode(short)[0]) == lengths[2] - 5


def test_gr00t_like_preset(tmp_path):
    root = generate_preset(tmp_path / "gr1", "gr00t-like", episodes=2, frames=(8, 10))
    info = json.loads((root / "meta/info.json").read_text())
    assert info["features"]["observation.images.ego_view"]["shape"] == [256, 256, 3]
    assert info["features"]["observation.state"]["shape"] == [44] == info["features"]["action"]["shape"]
    assert info["fps"] == 20 and info["total_chunks"] == 0 and info["robot_type"].startswith("GR1")
    modality = json.loads((root / "meta/modality.json").read_text())
    assert modality["state"]["waist"] == {"start": 41, "end": 44}
    frames, (codec, _, _), _ = _decode(next(root.rglob("*.mp4")))
    assert codec == "h264" and frames[0].shape == (256, 256, 3)
    assert set(PRESETS["gr00t-like"]["quirks"]) <= set(QUIRKS)


@pytest.mark.parametrize("kw", [{"quirks": ("nope",)}, {"frames": (5, 2)}, {"height": 63}, {"episodes": 0},
                                {"footage": "film"}])
def test_bad_arguments(tmp_path, kw):
    with pytest.raises(ConfigError):
        generate_dataset(tmp_path / "x", **kw)


def test_learnable_task_actions_follow_from_state_and_frame(tmp_path):
    """--task learnable: every action chunk is the known function of the current state and the target
    the frame shows (read back from the decoded H.264 colour cue), and the trivial baselines are poor."""
    from loongforge.preprocess.samples.learnable import CUE_GAIN, chunk_from

    root = generate_dataset(tmp_path / "l", episodes=3, frames=(40, 48), task="learnable", gop=6)
    info = json.loads((root / "meta/info.json").read_text())
    horizon, chunks, all_actions = 16, [], []
    for ep in range(3):
        table = pq.read_table(root / info["data_path"].format(episode_chunk=0, episode_index=ep))
        state = np.array(table.column("observation.state").to_pylist(), np.float64)
        action = np.array(table.column("action").to_pylist(), np.float64)
        all_actions.append(action)
        video = root / info["video_path"].format(episode_chunk=0, video_key="observation.images.ego_view",
                                                 episode_index=ep)
        frames, _, _ = _decode(video)
        assert len(frames) == len(state)
        for t in range(0, len(state) - horizon, 4):
            # The background (a corner away from the square) carries the target as colour.
            corner = np.concatenate([frames[t][:4, :4], frames[t][-4:, -4:]]).reshape(-1, 3).astype(np.float64)
            cue = np.median(corner, axis=0)
            corners_agree = np.abs(frames[t][:4, :4].mean((0, 1)) - frames[t][-4:, -4:].mean((0, 1))).max()
            if corners_agree > 8:  # the square covers a corner: use the other one's estimate only
                continue
            target = (cue[:2] - 128) / CUE_GAIN
            predicted = chunk_from(state[t], target, horizon)
            truth = action[t : t + horizon]
            chunks.append((truth, predicted, state[t]))
    assert len(chunks) > 15
    truth = np.stack([c[0] for c in chunks])
    oracle = np.mean((np.stack([c[1] for c in chunks]) - truth) ** 2)
    mean = np.mean((np.concatenate(all_actions).mean(0) - truth) ** 2)
    repeat = np.mean((np.stack([c[2] for c in chunks])[:, None] - truth) ** 2)
    # The function of (state, frame) explains the chunks; the baselines leave most of the variance.
    assert oracle < 0.02 * min(mean, repeat), (oracle, mean, repeat)
    assert min(mean, repeat) > 0.15


def test_learnable_task_is_deterministic_and_varies_per_episode(tmp_path):
    a = generate_dataset(tmp_path / "a", episodes=2, frames=(10, 12), task="learnable", cameras=("cam",))
    b = generate_dataset(tmp_path / "b", episodes=2, frames=(10, 12), task="learnable", cameras=("cam",))
    assert _tree_hash(a) == _tree_hash(b)
    s = [np.array(pq.read_table(p).column("observation.state").to_pylist()) for p in sorted(a.rglob("*.parquet"))]
    assert not np.allclose(s[0][:10], s[1][:10])
    with pytest.raises(ConfigError, match="task"):
        generate_dataset(tmp_path / "x", task="nope")


def test_cli_task_flag_reaches_the_generator(tmp_path):
    from loongforge.cli import main

    args = ["--episodes", "1", "--frames", "8", "8", "--cameras", "front"]
    assert main(["sample-data", str(tmp_path / "cli"), "--task", "learnable", *args]) == 0
    lib = generate_dataset(tmp_path / "lib", episodes=1, frames=(8, 8), cameras=("front",), task="learnable")
    assert _tree_hash(tmp_path / "cli") == _tree_hash(lib)
    plain = generate_dataset(tmp_path / "plain", episodes=1, frames=(8, 8), cameras=("front",))
    assert _tree_hash(plain) != _tree_hash(lib)


def test_camera_footage_static_scene_moving_arm(tmp_path):
    """--footage camera: real H.264, deterministic from the seed, and camera-like where the grain is not:
    most decoded pixels repeat exactly from frame to frame (static scene), yet every frame moves."""
    kw = {"episodes": 1, "frames": (40, 40), "height": 128, "width": 128, "cameras": ("ego_view",), "gop": 20}
    a = generate_dataset(tmp_path / "a", footage="camera", seed=3, **kw)
    assert _tree_hash(a) == _tree_hash(generate_dataset(tmp_path / "b", footage="camera", seed=3, **kw))
    grain = generate_dataset(tmp_path / "g", seed=3, **kw)
    cam_frames, (codec, pix_fmt, _), _ = _decode(next(a.rglob("*.mp4")))
    grain_frames, _, _ = _decode(next(grain.rglob("*.mp4")))
    assert (codec, pix_fmt) == ("h264", "yuv420p") and len(cam_frames) == 40

    def unchanged(frames):
        v = np.stack(frames).astype(np.int16)
        return float((v[1:] == v[:-1]).all(-1).mean())

    assert unchanged(cam_frames) > 0.5 > unchanged(grain_frames)
    diffs = [np.abs(x.astype(int) - y).max() for x, y in zip(cam_frames, cam_frames[1:])]
    assert min(diffs) > 20  # the arm moves in every frame


def test_camera_model_noise_is_the_only_difference_at_noise_zero():
    """The sensor noise is added on top of the render: noise=0 is the clean render, and the noisy frames
    differ from it by about `noise` DN (std), not by a changed scene."""
    from loongforge.preprocess.samples.camera import camera_frames

    clean = camera_frames(6, 64, 64, seed=1, noise=0.0)
    assert np.array_equal(clean, camera_frames(6, 64, 64, seed=1, noise=0.0))
    noisy = camera_frames(6, 64, 64, seed=1, noise=1.5).astype(np.float64)
    err = noisy - clean
    assert 1.0 < err.std() < 2.0 and abs(err.mean()) < 0.3


def test_hands_task_has_binary_commands_and_a_lagging_hand_state():
    hands = hand_dims(44)
    assert hands == [*range(7, 13), *range(29, 35)]  # GR1's left_hand and right_hand
    state, action, target = hands_episode(96, 44, 44, hands, np.random.default_rng(0))
    for k, j in enumerate(hands):
        level = HAND_LEVELS[k % 2]
        assert set(np.unique(action[:, j])) == {-level, level}
        assert len(np.unique(state[:, j])) > 2  # joint positions move towards the command, never jump
    arm = [j for j in range(44) if j not in hands]
    assert all(len(np.unique(action[:, j])) > 50 for j in arm)  # smooth, continuous
