"""Demonstrations from a simulator (`loongforge sample-data --sim metaworld:TASK --episodes N OUT`): the
task's scripted expert on seeded resets, written as a LeRobot v3.0 dataset.

    summary = write_demos("data/button", "metaworld:button-press-topdown-v3", episodes=50, size=56)

Episode e runs seed `seed + k` for the k-th attempt: the expert acts on the simulator's full state,
each step's frame is rendered once (one camera, at `size`, before the action), and the row holds the
robot's state (sim_env.STATE_KEYS), the action the env took (clipped to [-1, 1]), the timestamp and
the task. An episode ends at the step that succeeds; one that reaches the task's step limit
without success is left out and counted (`failed`, their seeds in meta/sim.json), and the next seed is
tried until N episodes succeeded (at most 2N + 10 attempts).

Writing: a lossless H.264 intermediate (v2.0 layout, crf 0), then layouts.write_v3 re-encodes every
camera to H.264 at `crf` and GOP 2 (LeRobot's encoder default), episodes concatenated per file, with
meta/modality.json (the keys above; `loongforge preprocess` with no tag gives new_embodiment with
absolute keys) and meta/sim.json (env, camera, size, fps, seeds kept and failed, steps per episode).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from loongforge.preprocess.samples.dataset import encode_mp4
from loongforge.preprocess.samples.layouts import write_v3
from loongforge.preprocess.samples.sim_env import (ACTION_KEYS, DEFAULT_CAMERA, EVAL_SEED_START, SIM_FILE,
                                                   STATE_KEYS, SimEnv, SimSpec, modality_json)
from loongforge.shared.errors import ConfigError

V2_DATA = "data/chunk-000/episode_{episode:06d}.parquet"
V2_VIDEO = "videos/chunk-000/{key}/episode_{episode:06d}.mp4"


def run_expert(env: SimEnv, seed: int, max_steps: int | None = None) -> tuple[dict, bool]:
    """One episode of the scripted expert: {"state" (T, Ds), "action" (T, 4), "frames" (T, H, W, 3),
    "render_s"}, success."""
    states, actions, frames = [], [], []
    state = env.reset(seed)
    ok, render_s = False, 0.0
    for _ in range(max_steps or env.max_steps):
        t = time.perf_counter()
        frames.append(env.render())
        render_s += time.perf_counter() - t
        action = env.expert()
        states.append(np.concatenate([state[k] for k in STATE_KEYS]))
        actions.append(action)
        state, ok = env.step(action)
        if ok:
            break
    return {"state": np.stack(states), "action": np.stack(actions), "frames": np.stack(frames),
            "render_s": render_s}, ok


def _table(ep: int, first: int, fps: int, episode: dict):
    import pyarrow as pa

    n = len(episode["state"])

    def fixed(a):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.astype(np.float32).reshape(-1), pa.float32()), a.shape[1])

    return pa.table({"observation.state": fixed(episode["state"]), "action": fixed(episode["action"]),
                     "timestamp": pa.array(np.arange(n, dtype=np.float32) / fps),
                     "task_index": pa.array(np.zeros(n, np.int64)), "episode_index": pa.array(np.full(n, ep, np.int64)),
                     "index": pa.array(np.arange(first, first + n, dtype=np.int64)),
                     "frame_index": pa.array(np.arange(n, dtype=np.int64)),
                     "next.done": pa.array(np.arange(n) == n - 1)})


def _info(spec: SimSpec, camera: str, size: int, fps: int, lengths: list[int]) -> dict:
    names = lambda keys: [f"{k}_{i}" for k, n in keys.items() for i in range(n)]  # noqa: E731
    features = {f"observation.images.{camera}": {
        "dtype": "video", "shape": [size, size, 3], "names": ["height", "width", "channel"],
        "video_info": {"video.fps": float(fps), "video.codec": "h264", "video.pix_fmt": "yuv420p",
                       "video.is_depth_map": False, "has_audio": False}},
        "observation.state": {"dtype": "float32", "shape": [sum(STATE_KEYS.values())], "names": names(STATE_KEYS)},
        "action": {"dtype": "float32", "shape": [sum(ACTION_KEYS.values())], "names": names(ACTION_KEYS)}}
    for name, dtype in (("timestamp", "float32"), ("task_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("frame_index", "int64"), ("next.done", "bool")):
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    return {"codebase_version": "v2.0", "robot_type": f"{spec.backend}_sawyer", "total_episodes": len(lengths),
            "total_frames": int(sum(lengths)), "total_tasks": 1, "total_videos": len(lengths), "total_chunks": 1,
            "chunks_size": 1000, "fps": fps, "splits": {"train": f"0:{len(lengths)}"}, "data_path":
            "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet", "video_path":
            "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4", "features": features}


def write_demos(out, sim: str | SimSpec, *, episodes: int, size: int = 56, camera: str = DEFAULT_CAMERA,
                seed: int = 0, crf: int = 18, max_steps: int | None = None, log=None) -> dict:
    """Write N successful expert episodes of `sim` as a LeRobot v3.0 dataset under `out`; the summary
    (also meta/sim.json): kept and failed seeds, steps, render and step seconds."""
    import pyarrow.parquet as pq

    spec = sim if isinstance(sim, SimSpec) else SimSpec.parse(sim)
    if episodes < 1:
        raise ConfigError(f"--episodes {episodes}: at least 1")
    if not 0 <= seed or seed + 2 * episodes + 10 > EVAL_SEED_START:
        raise ConfigError(f"--seed {seed}: demonstration seeds stay in [0, {EVAL_SEED_START}) (rollouts use the rest)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: exists and is not empty; choose a new directory")
    env = SimEnv(spec, size=size, camera=camera)
    kept, failed, lengths = [], [], []
    t0, frames_rendered, render_s = time.perf_counter(), 0, 0.0
    key = f"observation.images.{camera}"
    with tempfile.TemporaryDirectory(prefix="lf-sim-v2-") as tmp:
        src = Path(tmp)
        s, first = seed, 0
        while len(kept) < episodes and s < seed + 2 * episodes + 10:
            episode, ok = run_expert(env, s, max_steps)
            frames_rendered += len(episode["frames"])
            render_s += episode["render_s"]
            if ok:
                ep = len(kept)
                path = src / V2_DATA.format(episode=ep)
                path.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(_table(ep, first, env.fps, episode), path)
                encode_mp4(src / V2_VIDEO.format(key=key, episode=ep), episode["frames"], fps=env.fps, gop=2, crf=0)
                kept.append(s)
                lengths.append(len(episode["state"]))
                first += lengths[-1]
            else:
                failed.append(s)
            if log and (not ok or len(kept) % 10 == 0):
                log(f"seed {s}: {'success' if ok else 'failed'} in {len(episode['state'])} steps "
                    f"({len(kept)}/{episodes} kept)")
            s += 1
        env.close()
        if len(kept) < episodes:
            raise ConfigError(f"{spec}: the expert succeeded on {len(kept)} of {len(kept) + len(failed)} seeds; "
                              f"{episodes} were asked for")
        seconds = time.perf_counter() - t0
        meta = src / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        (meta / "info.json").write_text(json.dumps(_info(spec, camera, size, env.fps, lengths), indent=4) + "\n")
        (meta / "modality.json").write_text(json.dumps(modality_json(camera), indent=4) + "\n")
        (meta / "episodes.jsonl").write_text("".join(json.dumps({"episode_index": i, "tasks": [spec.instruction],
                                                                 "length": n}) + "\n" for i, n in enumerate(lengths)))
        (meta / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": spec.instruction}) + "\n")
        write_v3(src, out, codec="h264", gop=2, crf=crf)
    summary = {"env": str(spec), "camera": camera, "size": size, "fps": env.fps, "task": spec.instruction,
               "episodes": len(kept), "failed": len(failed), "seeds": kept, "failed_seeds": failed,
               "steps": lengths, "max_steps": max_steps or env.max_steps, "frames_rendered": frames_rendered,
               "seconds": round(seconds, 2), "render_frames_per_s": round(frames_rendered / max(render_s, 1e-9), 1),
               "env_steps_per_s": round(frames_rendered / seconds, 1)}
    (out / SIM_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
