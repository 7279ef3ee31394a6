"""A simulated task for demonstrations and closed-loop rollouts: `metaworld:TASK` (Meta-World v3 on
MuJoCo 3, the `[sim]` extra), rendered headless through OSMesa.

    env = SimEnv.make("metaworld:button-press-topdown-v3", size=56)
    obs = env.reset(seed=7)                     # {"hand_pos": (3,), "gripper": (1,)} robot units
    frame = env.render()                        # (56, 56, 3) uint8 RGB from camera corner2, upright
    action = env.expert()                       # the task's scripted policy (metaworld.policies)
    obs, success = env.step(action)             # (4,) float32: hand_delta (3) + grab_effort (1)

What the robot reports and takes is LeRobot's Meta-World interface (`agent_pos`: the hand's position
and the gripper's opening; the 4-D action the env takes, in [-1, 1]): the object's pose is not in the
state, so a policy must find it in the camera. The scripted expert reads the simulator's full
observation (the object's pose included), as Meta-World's own policies do.

Seeded resets: `reset(seed)` draws the task's object and goal positions from `seed` alone
(Meta-World's `seeded_rand_vec`), so seed s is the same scene wherever it runs; demonstrations and
evaluation take disjoint seed ranges (`EVAL_SEED_START`).

Rendering is the cost (software OpenGL): one camera, at the size the recipe trains on, with MuJoCo's
shadows, reflections and multisampling off (4x faster through OSMesa, measured: 34 -> 8.6 ms a
56x56 frame), the frame rotated 180 degrees (Meta-World's corner cameras look upside down; LeRobot
flips them too).
"""

from __future__ import annotations

import ctypes.util
import os
import warnings
from dataclasses import dataclass

import numpy as np

from loongforge.shared.errors import ConfigError

BACKENDS = ("metaworld",)
DEFAULT_CAMERA = "corner2"
DEFAULT_SIZE = 84  # pixels: the tiny-sim recipe's image edge (render what the recipe trains on, nothing more)
EVAL_SEED_START = 1_000_000  # rollouts start here; demonstrations take seeds below it
STATE_KEYS = {"hand_pos": 3, "gripper": 1}  # Meta-World's obs[0:3], obs[3]
ACTION_KEYS = {"hand_delta": 3, "grab_effort": 1}  # the env's 4-D action, as it takes it
SIM_FILE = "meta/sim.json"  # what generated a sim dataset: env, camera, size, seeds (kept and failed)


@dataclass(frozen=True, slots=True)
class SimSpec:
    backend: str
    task: str

    @classmethod
    def parse(cls, text: str) -> "SimSpec":
        backend, _, task = str(text).partition(":")
        if backend not in BACKENDS or not task:
            raise ConfigError(f"--sim/--env {text!r}: expected BACKEND:TASK with BACKEND one of {BACKENDS}, e.g. "
                              "metaworld:button-press-topdown-v3")
        return cls(backend, task)

    def __str__(self) -> str:
        return f"{self.backend}:{self.task}"

    @property
    def instruction(self) -> str:
        """The task string of its demonstrations: Meta-World's task name in words."""
        name = self.task[:-3] if self.task.endswith("-v3") else self.task
        return name.replace("-", " ")


def headless_gl() -> None:
    """MuJoCo renders through OSMesa (software OpenGL) unless the user chose a backend; no display needed.
    The library is Debian's libosmesa6, which `make setup` installs."""
    os.environ.setdefault("MUJOCO_GL", "osmesa")
    if os.environ["MUJOCO_GL"] == "osmesa":
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
        if ctypes.util.find_library("OSMesa") is None:
            raise ConfigError("rendering needs OSMesa (software OpenGL): `apt-get install libosmesa6` (`make setup` "
                              "does it), or set MUJOCO_GL=egl on a machine with a GPU")


def _import_metaworld():
    headless_gl()  # before mujoco is imported: it reads MUJOCO_GL once
    try:
        import metaworld  # the [sim] extra: only sim commands import it
        import mujoco
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE
        from metaworld.policies import ENV_POLICY_MAP
    except ImportError as exc:
        raise ConfigError(f"the simulator is not installed ({exc}): pip install 'loongforge[sim]' (make setup "
                          "installs it)") from None
    return metaworld, mujoco, ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE, ENV_POLICY_MAP


class SimEnv:
    """One Meta-World task with its renderer and its scripted expert."""

    def __init__(self, spec: SimSpec, *, size: int = 56, camera: str = DEFAULT_CAMERA):
        if size < 8 or size % 2:
            raise ConfigError(f"render size {size}: an even number of pixels >= 8 (H.264 yuv420p)")
        _, mujoco, envs, policies = _import_metaworld()
        key = f"{spec.task}-goal-observable"
        if key not in envs:
            names = sorted(k.removesuffix("-goal-observable") for k in envs)
            raise ConfigError(f"{spec}: no such Meta-World task; one of {', '.join(names)}")
        self.spec, self.size, self.camera = spec, size, camera
        self._mujoco = mujoco
        self.env = envs[key](seed=0)
        self.env.model.vis.quality.offsamples = 0  # no multisampling: the frames are downscaled anyway
        names = [self.env.model.camera(i).name for i in range(self.env.model.ncam)]
        if camera not in names:
            raise ConfigError(f"camera {camera!r}: {spec} has {names}")
        self.renderer = mujoco.Renderer(self.env.model, size, size)
        self.policy = policies[spec.task]()
        self.max_steps = int(self.env.max_path_length)
        self.fps = int(round(1.0 / self.env.dt))
        self._obs: np.ndarray | None = None

    @classmethod
    def make(cls, spec: str | SimSpec, **kw) -> "SimEnv":
        return cls(spec if isinstance(spec, SimSpec) else SimSpec.parse(spec), **kw)

    def reset(self, seed: int) -> dict[str, np.ndarray]:
        env = self.env
        env._freeze_rand_vec, env.seeded_rand_vec = False, True  # object and goal drawn from this seed alone
        env.seed(int(seed))
        self._obs, _ = env.reset()
        return self.state()

    def state(self) -> dict[str, np.ndarray]:
        o = np.asarray(self._obs, np.float32)
        return {"hand_pos": o[0:3].copy(), "gripper": o[3:4].copy()}

    def render(self) -> np.ndarray:
        r, flags = self.renderer, self._mujoco.mjtRndFlag
        r.update_scene(self.env.data, camera=self.camera)
        r.scene.flags[flags.mjRND_SHADOW] = 0
        r.scene.flags[flags.mjRND_REFLECTION] = 0
        return np.ascontiguousarray(r.render()[::-1, ::-1])

    def expert(self) -> np.ndarray:
        with warnings.catch_warnings():  # Meta-World's policies warn that their gains exceed the clip
            warnings.simplefilter("ignore", UserWarning)
            a = self.policy.get_action(self._obs)
        return np.clip(np.asarray(a, np.float32), -1.0, 1.0)

    def step(self, action) -> tuple[dict[str, np.ndarray], bool]:
        """One env step of a (4,) action (clipped to the env's [-1, 1]) -> (state, success)."""
        a = np.clip(np.asarray(action, np.float64).reshape(-1), -1.0, 1.0)
        if a.shape != (4,) or not np.isfinite(a).all():
            raise ConfigError(f"{self.spec}: an action of 4 finite values expected, got {np.asarray(action).shape}")
        self._obs, _, _, _, info = self.env.step(a)
        return self.state(), bool(info.get("success", False))

    def close(self) -> None:
        self.renderer.close()
        self.env.close()


def flat_action(action: dict[str, np.ndarray]) -> np.ndarray:
    """{action key: (..., D)} -> (..., 4) in the env's order."""
    return np.concatenate([np.asarray(action[k], np.float32) for k in ACTION_KEYS], axis=-1)


def modality_json(camera: str) -> dict:
    """meta/modality.json of a sim dataset: its state and action keys, one camera, the task string."""
    def ranges(keys):
        out, start = {}, 0
        for k, n in keys.items():
            out[k] = {"start": start, "end": start + n}
            start += n
        return out

    return {"state": ranges(STATE_KEYS), "action": ranges(ACTION_KEYS),
            "video": {camera: {"original_key": f"observation.images.{camera}"}},
            "annotation": {"human.task_description": {"original_key": "task_index"}}}
