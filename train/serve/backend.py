"""What the policy server serves: a backend (the interface is server.py's `Backend`), implemented
here over Policy and its N1.6 processor (train/data/processor.py).

The server knows nothing of models, and imports none (its process loads torch only for a backend).
It calls, per request:

    get_modality_config() -> {modality: ModalityConfig fields}   (video, state, action, language)
    prepare(observation, options) -> Prepared                    decode + check + preprocess, no model
    run(prepared) -> (action, info)                              the model, then actions per action key
    reset(options) -> info

`prepare` raises RequestError, one line naming the key and the shape or dtype expected, for anything
outside the modality config; `run` never sees a bad observation. A request answers B observations
(`[B, ...]` arrays) with one `run`: one forward of the batch.

The layout is Isaac-GR00T's (Gr00tPolicy.get_action): per video key `[B, T, H, W, 3]` uint8 RGB at the
camera's own size (the processor letterboxes and resizes it as training did), per state key `[B, T, D]`
in robot units, per language key B lists of one string; the action comes back per action key as
`[B, horizon, D]` float32 in the robot's units, relative keys made absolute from the observation's
state. The modality config is the embodiment's, from the run's checkpoint or the export's
processor_config.json: no data root is needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loongforge.shared.errors import CheckpointError, ConfigError, RequestError, UsageError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.eval.policy import DEFAULT_SAMPLES, Policy
from loongforge.train.serve.protocol import short

MAX_BATCH = 64  # observations per request: bounds the memory one request can ask for
MAX_FLOW_STEPS = 64
MAX_SAMPLES = 64
MAX_SEED = 2**63 - 1 - MAX_SAMPLES  # seeds seed..seed+samples-1 stay int64 (torch.Generator)
OPTIONS = ("seed", "steps", "samples")  # what a request's options may set (the server's defaults otherwise)


@dataclass(frozen=True, slots=True)
class Defaults:
    """A request's flow settings when its options say nothing: N1.6's 4 Euler steps (the model's
    num_inference_timesteps unless `steps`), Policy's K-sample mean, seeds from `seed`."""

    steps: int | None = None
    samples: int = DEFAULT_SAMPLES
    seed: int = 0

    def __post_init__(self):
        for flag, value, lo, hi in (("--steps", self.steps, 1, MAX_FLOW_STEPS), ("--samples", self.samples, 1,
                                    MAX_SAMPLES), ("--seed", self.seed, 0, MAX_SEED)):
            if value is not None and not lo <= value <= hi:
                raise UsageError(f"{flag} {value}: between {lo} and {hi}")


@dataclass(frozen=True, slots=True)
class Prepared:
    batch: dict  # the processor's batch of the observation, on the device
    raw_state: dict  # {state key: (B, T, D)} robot units: relative actions are made absolute from it
    size: int
    steps: int
    samples: int
    seed: int


class PolicyBackend:
    """A Policy behind the GR00T layout, for one embodiment tag (the run's only one unless `tag`)."""

    def __init__(self, policy: Policy, defaults: Defaults = Defaults(), tag: str | None = None):
        self.policy, self.defaults = policy, defaults
        self.tag = policy.tag(tag)
        self.sa = policy.processor.state_action(self.tag)
        cfg = self.sa.config
        self.modality = cfg.to_json()
        self.cameras = list(cfg.video.modality_keys)
        self.t_video, self.t_state = len(cfg.video.delta_indices), len(cfg.state.delta_indices)
        self.state_keys = dict(self.sa.state_dims)
        self.language_keys = list(cfg.language.modality_keys)

    def get_modality_config(self) -> dict[str, dict]:
        return self.modality

    def reset(self, options: Any) -> dict:
        return {}  # the policy keeps no state between requests

    def prepare(self, observation: Any, options: Any) -> Prepared:
        steps, samples, seed = self._options(options)
        obs = _map(observation, "observation")
        video, state, language = (_map(obs.get(m), f"observation[{m!r}]") for m in ("video", "state", "language"))
        b = self._batch_size(video, state, language)
        for key in self.cameras:
            _frames(video, key, b, self.t_video)
        for key, d in self.state_keys.items():
            value = _array(state, key, "state", np.float32, (b, self.t_state, d), "float32 [B, T, D], robot units")
            if not np.isfinite(value).all():
                raise RequestError(f"observation['state'][{key!r}]: NaN or infinity; send finite values")
        tasks = _language(language, self.language_keys[0], b)
        gr00t = {"video": {k: video[k] for k in self.cameras}, "state": {k: state[k] for k in self.state_keys},
                 "language": {self.language_keys[0]: tasks}}
        try:
            batch, raw_state = self.policy.processor.observation(gr00t, self.tag, self.policy.device,
                                                                 self.policy.prompt_encoder(self.tag))
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        return Prepared(batch, raw_state, b, steps, samples, seed)

    def run(self, p: Prepared) -> tuple[dict[str, np.ndarray], dict]:
        with torch.inference_mode():
            normalized = self.policy.flow(p.batch, self.tag, self.cameras, p.steps, p.seed, p.samples)
        out = self.policy.processor.decode(normalized, p.raw_state, self.tag)
        action = {key: np.ascontiguousarray(v, dtype=np.float32) for key, v in out.items()}
        return action, {"steps": p.steps, "samples": p.samples, "seed": p.seed}

    def _options(self, options: Any) -> tuple[int, int, int]:
        opts = {} if options is None else _map(options, "options")
        unknown = [k for k in opts if k not in OPTIONS]
        if unknown:
            raise RequestError(f"options: unknown key(s) {short(unknown)}; this server takes {list(OPTIONS)} or nil")
        d = self.defaults
        steps = _int(opts, "steps", d.steps or self.policy.cfg.num_inference_timesteps, 1, MAX_FLOW_STEPS)
        samples = _int(opts, "samples", d.samples, 1, MAX_SAMPLES)
        seed = _int(opts, "seed", d.seed, 0, MAX_SEED)
        return steps, samples, seed

    def _batch_size(self, video: dict, state: dict, language: dict) -> int:
        sizes = {f"video[{k!r}]": _len(video.get(k)) for k in self.cameras}
        sizes |= {f"state[{k!r}]": _len(state.get(k)) for k in self.state_keys}
        sizes |= {f"language[{k!r}]": _len(language.get(k)) for k in self.language_keys}
        found = {n for n in sizes.values() if n is not None}
        if len(found) > 1:
            raise RequestError(f"observation: batch sizes differ across keys ({short(sizes, 200)}); every key "
                               "needs the same B")
        b = found.pop() if found else 0
        if not 1 <= b <= MAX_BATCH:
            raise RequestError(f"observation: batch size {b}; send 1 to {MAX_BATCH} observations per request")
        return b


MAX_SIDE = 4096  # a camera image larger than this on a side is refused (the processor resizes to 256 anyway)


def _frames(video: dict, key: str, b: int, t: int) -> np.ndarray:
    where = f"observation['video'][{key!r}]"
    what = f"uint8 RGB 0-255 [B, T, H, W, 3] (B={b}, T={t})"
    if key not in video:
        raise RequestError(f"{where} missing: expected {what} (keys here: {short(sorted(map(str, video)), 120)})")
    value = video[key]
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{where}: expected an ndarray {what}; got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise RequestError(f"{where}: dtype {value.dtype}; expected {what}")
    if value.ndim != 5 or value.shape[:2] != (b, t) or value.shape[-1] != 3 or not \
            (1 <= value.shape[2] <= MAX_SIDE and 1 <= value.shape[3] <= MAX_SIDE):
        raise RequestError(f"{where}: shape {list(value.shape)}; expected {what}, sides 1..{MAX_SIDE}")
    return value


def _map(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be a map; got {type(value).__name__}")
    return value


def _len(value: Any) -> int | None:
    if isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim else None
    return len(value) if isinstance(value, list) else None


def _array(group: dict, key: str, kind: str, dtype, shape: tuple, what: str) -> np.ndarray:
    where = f"observation[{kind!r}][{key!r}]"
    if key not in group:
        raise RequestError(f"{where} missing: expected {what} of shape {list(shape)} (keys here: "
                           f"{short(sorted(map(str, group)), 120)})")
    value = group[key]
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{where}: expected an ndarray {what} of shape {list(shape)}; got {type(value).__name__}")
    if value.dtype != dtype:
        raise RequestError(f"{where}: dtype {value.dtype}; expected {what} of shape {list(shape)}")
    if value.shape != shape:
        raise RequestError(f"{where}: shape {list(value.shape)}; expected {what} of shape {list(shape)}")
    return value


def _language(group: dict, key: str, b: int) -> list[str]:
    where = f"observation['language'][{key!r}]"
    value = group.get(key)
    ok = isinstance(value, list) and len(value) == b and all(
        isinstance(v, list) and len(v) == 1 and isinstance(v[0], str) for v in value)
    if not ok:
        missing = " missing" if key not in group else ""
        raise RequestError(f"{where}{missing}: expected {b} list(s) of one instruction string "
                           f"([[\"pick the cube\"]] for B=1); got {short(value)}")
    return [v[0] for v in value]


def _int(opts: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = opts.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"options[{key!r}]: {short(value)}; expected an integer in [{lo}, {hi}]")
    return value


# ---- loading: a run directory or an exported GR00T directory ----


def load_backend(path: str, *, data_root: str | None = None, tag: str | None = None, device: str = "cpu",
                 defaults: Defaults = Defaults(), embodiment: str | None = None) -> PolicyBackend:
    """A run directory (its `tag`, default latest) or a `loongforge export` directory, on `device`.
    `data_root` is not needed (the processor is in the checkpoint / the export's processor files); with it,
    the older observation form's NV12 frames convert in the root's colour. `embodiment`: which tag to serve
    when the run trained several."""
    if os.path.isdir(ckpt_files.ckpt_root(path)):
        tag = tag or ckpt_files.latest_tag(path)
        if tag is None:
            raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(path)}; did training finish?")
        if not os.path.isdir(os.path.join(ckpt_files.ckpt_root(path), tag)):
            raise UsageError(f"{tag}: no such checkpoint under {ckpt_files.ckpt_root(path)} (latest: "
                             f"{ckpt_files.latest_tag(path)})")
        return PolicyBackend(Policy.load(path, data_root, tag=tag, device=device), defaults, embodiment)
    if os.path.exists(os.path.join(path, "config.json")):
        if tag is not None:
            raise UsageError(f"{path}: an exported directory holds one checkpoint; --step/--tag are for run "
                             "directories")
        return PolicyBackend(Policy.from_export(path, device=device), defaults, embodiment)
    raise UsageError(f"{path}: neither a run directory (checkpoints/) nor an exported GR00T directory (config.json)")
