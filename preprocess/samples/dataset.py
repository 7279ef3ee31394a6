"""Deterministic generator of LeRobot v2.x datasets (the layout GR00T trains on).

    generate_dataset("data/sample")                           # 3 episodes, 2 cameras, 64x64
    generate_dataset("data/gr1", **PRESETS["gr00t-like"])     # 256x256, 44-D, metadata quirks
    generate_dataset("data/learn", task="learnable")          # actions = f(state, frame content)
    generate_dataset("data/fit", **PRESETS["gr00t-like"], task="hands")  # + binary hand commands

Videos are real H.264 (libx264, yuv420p) encoded through PyAV, with moving
content (drifting gradient, a moving square, a scrolling noise texture), so
decoders, resizers and zstd see non-trivial frames. `footage="camera"`
renders a fixed robot camera instead (samples/camera.py: static scene, a moving
arm and cube, slow lighting change, sensor noise): what storage of decoded
frames should be measured on, since the grain makes every pixel change. Encoding is
single-threaded, which makes x264 output (and so the whole tree) a pure
function of the arguments.

`task="learnable"` makes a dataset a policy can be scored on (samples/learnable.py):
the action chunk is an exact function of the current state and of what the
frames show, with per-episode variety, so predict-the-mean and repeat-last
baselines do poorly and a model that learned something beats them. `task="hands"` is that
task with the hand (GR1 44-D: left_hand, right_hand) or gripper dims as binary commands of
+-1.5 / +-3 whose switch the frames show, the hand state lagging behind them: GR00T's
arm-plus-hand-commands shape, for the fit test (tests/train/test_fit.py).

`quirks` inject what real datasets get wrong:
  missing_camera     info.json lists a camera that has no video files at all
  splits_beyond      splits name more episodes than exist
  total_chunks_zero  info.json says total_chunks: 0
  corrupt_video      one episode's mp4 is truncated (unreadable)
  length_mismatch    one episode's video has fewer frames than its parquet rows
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from loongforge.preprocess.samples.camera import camera_frames
from loongforge.preprocess.samples.learnable import hands_episode, learnable_episode, learnable_frames
from loongforge.shared import color
from loongforge.shared.errors import ConfigError

TASK_MODES = ("default", "learnable", "hands")
# grain: the original drifting gradient + scrolling noise texture (every pixel changes every frame:
# the worst case for storing decoded frames); camera: sample_camera's fixed robot camera model.
FOOTAGE_KINDS = ("grain", "camera")
QUIRKS = ("missing_camera", "splits_beyond", "total_chunks_zero", "corrupt_video", "length_mismatch")
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
CHUNKS_SIZE = 1000
TASKS = ("pick up the red cube and place it in the bowl", "open the top drawer", "push the green block left",
         "pour the cup into the sink")
MISSING_CAMERA = "observation.images.side_view"
# GR1 humanoid layout of the GR00T sample data: 44 joints in named sub-ranges.
GR1_PARTS = (("left_arm", 7), ("left_hand", 6), ("left_leg", 6), ("neck", 3), ("right_arm", 7),
             ("right_hand", 6), ("right_leg", 6), ("waist", 3))
# GR00T N1.6's registered oxe_droid embodiment (shared/embodiment.py): two cameras, 7 joints + a gripper,
# the instruction under annotation.language.language_instruction.
DROID_PARTS = (("joint_position", 7), ("gripper_position", 1))
DROID_CAMERAS = ("exterior_image_1_left", "wrist_image_left")
PRESETS = {
    "default": {},
    # A dataset `loongforge preprocess --embodiment-tag oxe_droid` takes as it is (the demo's).
    "oxe-droid": {"cameras": DROID_CAMERAS, "state_dim": 8, "action_dim": 8, "fps": 15, "robot_type": "oxe_droid"},
    # "A real LeRobot v2.0 dataset as found": one 256x256 H.264 camera at 20 fps,
    # 44-D state/action, and the metadata quirks such datasets ship with.
    "gr00t-like": {"height": 256, "width": 256, "fps": 20, "cameras": ("ego_view",), "state_dim": 44,
                   "action_dim": 44, "gop": 20, "robot_type": "GR1ArmsAndWaistFourierHands",
                   "quirks": ("splits_beyond", "total_chunks_zero", "missing_camera")},
}


def _parts(dim: int, robot: str = "") -> list[tuple[str, int]]:
    if robot == "oxe_droid" and dim == sum(n for _, n in DROID_PARTS):
        return list(DROID_PARTS)
    if dim == sum(n for _, n in GR1_PARTS):
        return list(GR1_PARTS)
    return [("arm", dim - 1), ("gripper", 1)] if dim > 1 else [("joint", dim)]


def hand_dims(dim: int) -> list[int]:
    """Action dims of the hands (GR1: left_hand, right_hand) or the gripper: the `hands` task's binary ones."""
    out, start = [], 0
    for part, n in _parts(dim):
        if part.endswith("hand") or part == "gripper":
            out += range(start, start + n)
        start += n
    return out


def _names(dim: int, robot: str = "") -> list[str]:
    return [f"{part}_{i}" for part, n in _parts(dim, robot) for i in range(n)]


def _modality(state_dim: int, action_dim: int, cameras: tuple[str, ...], robot: str = "") -> dict:
    def ranges(dim):
        out, start = {}, 0
        for part, n in _parts(dim, robot):
            out[part] = {"start": start, "end": start + n}
            start += n
        return out

    notes = {"language.language_instruction": {"original_key": "task_index"}} if robot == "oxe_droid" else \
        {"human.action.task_description": {}, "human.validity": {}}
    return {
        "state": ranges(state_dim),
        "action": ranges(action_dim),
        "video": {cam: {"original_key": f"observation.images.{cam}"} for cam in cameras},
        "annotation": notes,
    }


def _texture(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Blotchy low-frequency noise plus a little grain, twice the frame width so
    it can scroll. Camera-like: per-pixel white noise would make frames nearly
    incompressible for zstd (unlike real footage) and inflate the mp4 bitrate."""
    cell = max(2, height // 16)
    coarse = rng.integers(-20, 21, size=(height // cell + 2, 2 * width // cell + 2, 1)).astype(np.float32)
    tex = np.repeat(np.repeat(coarse, cell, axis=0), cell, axis=1)
    half = cell // 2
    tex = (tex + np.roll(tex, half, 0) + np.roll(tex, half, 1) + np.roll(tex, (half, half), (0, 1))) / 4
    return tex[:height, : 2 * width] + rng.integers(-2, 3, size=(height, 2 * width, 1))


def _frames_rgb(n: int, height: int, width: int, phase: float, rng: np.random.Generator) -> np.ndarray:
    """(n, h, w, 3) uint8 of moving content, vectorised over the whole clip."""
    t = np.arange(n, dtype=np.float32)[:, None, None]
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 128 + 100 * np.sin((xx / width * 2 + t * 0.05 + phase) * np.pi)
    g = 128 + 100 * np.cos((yy / height * 2 - t * 0.07 + phase) * np.pi)
    b = 64 + 0.5 * (xx + yy) + 8 * np.sin(t * 0.3 + phase)
    rgb = np.stack(np.broadcast_arrays(r, g, b), axis=-1)
    texture = _texture(height, width, rng)
    side = max(4, height // 5)
    for i in range(n):  # per-frame (not per-pixel) loop: scroll the texture, place the square
        shift = (i * 2) % width
        rgb[i] += texture[:, shift : shift + width]
        y0 = int((height - side) * (0.5 + 0.4 * np.sin(i * 0.15 + phase)))
        x0 = int((width - side) * (0.5 + 0.4 * np.cos(i * 0.11 + phase)))
        rgb[i, y0 : y0 + side, x0 : x0 + side] = (230, 40, 40)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def _rgb_to_i420(rgb: np.ndarray) -> np.ndarray:
    """(n, h, w, 3) RGB -> (n, 3h/2, w) planar yuv420p, BT.601 limited range.
    Done in numpy so the source colour matrix/range is known exactly (the
    preprocess fidelity tests rely on BT.601 limited)."""
    n, h, w, _ = rgb.shape
    nv12 = color.rgb_to_nv12(rgb, "bt601", "limited")
    y, u, v = color.split_planes(nv12)
    return np.concatenate((y.reshape(n, -1), u.reshape(n, -1), v.reshape(n, -1)), axis=1).reshape(n, h * 3 // 2, w)


def encode_mp4(path: str | Path, rgb: np.ndarray, *, fps: int, gop: int, crf: int = 23) -> None:
    """Encode (n, h, w, 3) uint8 RGB to H.264 mp4 (libx264, yuv420p, fixed GOP)."""
    import av

    n, height, width, _ = rgb.shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # The generator promises byte-identical files for equal arguments:
        # threads=1 (threaded x264 depends on scheduling) and mbtree=0 (with
        # macroblock-tree rate control, this x264 build (core 165) gave different
        # bitstreams for identical input; B-frames and lookahead stay on).
        stream.codec_context.options = {
            "crf": str(crf), "preset": "veryfast", "threads": "1",
            "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:mbtree=0",
        }
        i420 = _rgb_to_i420(rgb)
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(i420[i], format="yuv420p")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    os.replace(tmp, path)


def _trajectory(n: int, state_dim: int, action_dim: int, rng: np.random.Generator):
    t = np.arange(n + 1, dtype=np.float32)[:, None]
    freq = rng.uniform(0.02, 0.2, size=(1, max(state_dim, action_dim))).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(1, max(state_dim, action_dim))).astype(np.float32)
    traj = np.sin(t * freq + phase).astype(np.float32)
    return traj[:n, :state_dim], traj[1 : n + 1, :action_dim]  # the action is where the state goes next


def _episode_table(ep: int, first_index: int, task_index: int, fps: int, state: np.ndarray, action: np.ndarray):
    import pyarrow as pa

    n = len(state)

    def fixed_list(a):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), pa.float32()), a.shape[1])

    return pa.table({
        "observation.state": fixed_list(state),
        "action": fixed_list(action),
        "timestamp": pa.array(np.arange(n, dtype=np.float32) / fps),
        "annotation.human.action.task_description": pa.array(np.full(n, task_index, np.int64)),
        "task_index": pa.array(np.full(n, task_index, np.int64)),
        "annotation.human.validity": pa.array(np.ones(n, np.int64)),
        "episode_index": pa.array(np.full(n, ep, np.int64)),
        "index": pa.array(np.arange(first_index, first_index + n, dtype=np.int64)),
        "frame_index": pa.array(np.arange(n, dtype=np.int64)),
        "next.done": pa.array(np.arange(n) == n - 1),
    })


def _info(episodes, lengths, height, width, fps, cameras, state_dim, action_dim, robot_type, quirks, n_tasks):
    video_info = {"video.fps": float(fps), "video.codec": "h264", "video.pix_fmt": "yuv420p",
                  "video.is_depth_map": False, "has_audio": False}
    keys = [f"observation.images.{c}" for c in cameras] + ([MISSING_CAMERA] if "missing_camera" in quirks else [])
    features = {key: {"dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channel"],
                      "video_info": dict(video_info)} for key in keys}
    features["observation.state"] = {"dtype": "float32", "shape": [state_dim], "names": _names(state_dim, robot_type)}
    features["action"] = {"dtype": "float32", "shape": [action_dim], "names": _names(action_dim, robot_type)}
    # Every parquet column is a feature: LeRobotDataset loads the parquet with this schema and refuses
    # a file holding a column it does not list.
    for name, dtype in (("timestamp", "float32"), ("task_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("frame_index", "int64"),
                        ("annotation.human.action.task_description", "int64"),
                        ("annotation.human.validity", "int64"), ("next.done", "bool")):
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    return {
        "codebase_version": "v2.0",
        "robot_type": robot_type,
        "total_episodes": episodes,
        "total_frames": int(sum(lengths)),
        "total_tasks": n_tasks,
        "total_videos": episodes * len(cameras),
        "total_chunks": 0 if "total_chunks_zero" in quirks else (episodes - 1) // CHUNKS_SIZE + 1,
        "chunks_size": CHUNKS_SIZE,
        "fps": fps,
        "splits": {"train": f"0:{episodes + 100 if 'splits_beyond' in quirks else episodes}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": features,
    }


def _write_json(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=4) + "\n")


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def generate_dataset(root, *, episodes: int = 3, frames: tuple[int, int] = (40, 60), height: int = 64,
                     width: int = 64, fps: int = 20, cameras: tuple[str, ...] = ("ego_view", "wrist_view"),
                     state_dim: int = 8, action_dim: int = 8, gop: int = 10, crf: int = 23, seed: int = 0,
                     quirks: tuple[str, ...] = (), robot_type: str = "sim_arm", task: str = "default",
                     footage: str = "grain") -> Path:
    """Write a LeRobot v2.0 dataset under `root` and return its path. `footage` picks what the
    default task's videos show (FOOTAGE_KINDS); the learnable task draws its own frames."""
    import pyarrow.parquet as pq

    unknown = sorted(set(quirks) - set(QUIRKS))
    if unknown:
        raise ConfigError(f"quirks {unknown}: unknown; choose from {QUIRKS}")
    if task not in TASK_MODES:
        raise ConfigError(f"task {task!r}: unknown; choose from {TASK_MODES}")
    if footage not in FOOTAGE_KINDS:
        raise ConfigError(f"footage {footage!r}: unknown; choose from {FOOTAGE_KINDS}")
    if episodes < 1 or frames[0] < 2 or frames[1] < frames[0]:
        raise ConfigError(f"episodes={episodes}, frames={frames}: need episodes >= 1 and 2 <= A <= B")
    if height % 2 or width % 2 or gop < 1:
        raise ConfigError(f"size {height}x{width}, gop {gop}: H.264 yuv420p needs even sizes and gop >= 1")
    root = Path(root)
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(frames[0], frames[1] + 1, size=episodes)]
    corrupt_ep = min(1, episodes - 1) if "corrupt_video" in quirks else -1
    short_ep = episodes - 1 if "length_mismatch" in quirks else -1
    n_tasks = min(len(TASKS), episodes)
    first = 0
    for ep, n in enumerate(lengths):
        chunk = ep // CHUNKS_SIZE
        task_index = ep % n_tasks
        if task == "learnable":
            state, action, cue = learnable_episode(n, state_dim, action_dim, rng)
        elif task == "hands":
            state, action, cue = hands_episode(n, state_dim, action_dim, hand_dims(action_dim), rng)
        else:
            state, action = _trajectory(n, state_dim, action_dim, rng)
        table = _episode_table(ep, first, task_index, fps, state, action)
        parquet = root / DATA_PATH.format(episode_chunk=chunk, episode_index=ep)
        parquet.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, parquet)
        first += n
        for c, cam in enumerate(cameras):
            n_video = max(1, n - 5) if ep == short_ep else n
            if task in ("learnable", "hands"):
                rgb = learnable_frames(cue[:n_video], height, width, camera=c)
            elif footage == "camera":
                # its own seed per (episode, camera), drawn from the dataset's stream
                rgb = camera_frames(n_video, height, width, seed=int(rng.integers(2**31)))
            else:
                rgb = _frames_rgb(n_video, height, width, phase=ep * 0.7 + c * 1.3, rng=rng)
            mp4 = root / VIDEO_PATH.format(episode_chunk=chunk, video_key=f"observation.images.{cam}",
                                           episode_index=ep)
            encode_mp4(mp4, rgb, fps=fps, gop=gop, crf=crf)
            if ep == corrupt_ep and c == 0:
                data = mp4.read_bytes()  # mp4 with its moov atom cut off: unreadable
                mp4.write_bytes(data[: len(data) * 2 // 5])
    meta = root / "meta"
    _write_json(meta / "info.json", _info(episodes, lengths, height, width, fps, cameras, state_dim, action_dim,
                                          robot_type, quirks, n_tasks))
    _write_json(meta / "modality.json", _modality(state_dim, action_dim, cameras, robot_type))
    _write_jsonl(meta / "episodes.jsonl", ({"episode_index": ep, "tasks": [TASKS[ep % n_tasks]], "length": n}
                                           for ep, n in enumerate(lengths)))
    _write_jsonl(meta / "tasks.jsonl", ({"task_index": i, "task": TASKS[i]} for i in range(n_tasks)))
    return root


def generate_preset(root, preset: str, **overrides) -> Path:
    if preset not in PRESETS:
        raise ConfigError(f"preset {preset!r}: unknown; choose from {sorted(PRESETS)}")
    return generate_dataset(root, **{**PRESETS[preset], **overrides})
