"""What the policy server serves: a backend (the interface is server.py's `Backend`), implemented
here over today's Policy.

The server knows nothing of models, and imports none (its process loads torch only for a backend).
It calls, per request:

    get_modality_config() -> {modality: ModalityConfig fields}   (video, state, action, language)
    prepare(observation, options) -> Prepared                    decode + check + preprocess, no model
    run(prepared) -> (action, info)                              the model, then actions per action key
    reset(options) -> info

`prepare` raises RequestError, one line naming the key and the shape or dtype expected, for anything
outside the modality config; `run` never sees a bad observation. A request answers B observations
(`[B, ...]` arrays) with one `run`: one forward of the batch.

The layout is Isaac-GR00T's (Gr00tPolicy.get_action): per video key `[B, T, H, W, 3]` uint8 RGB, per
state key `[B, T, D]` float32, per language key B lists of one string; the action comes back per action
key as `[B, horizon, D]` float32 in the robot's units.

PolicyBackend maps that layout onto Policy.predict_action's (per-camera-slot frames, a (K, Ds) state,
a task string): video keys are the data root's camera slots at the run's video deltas, state and
action keys the groups of the root's modality.json (ckpt/export.py's `processor_files`, so the served
modality config is the one `loongforge export` writes), frames at the size the root stores them, and
actions absolute (what the run trained on). The processor module replaces this mapping.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loongforge.shared.errors import CheckpointError, ConfigError, RequestError, UsageError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.export import embodiment_tag, groups, processor_files
from loongforge.train.ckpt.gr00t import load_gr00t_weights
from loongforge.train.data.processor import processor_from_gr00t_json
from loongforge.train.data.prompt import has_tokenizer
from loongforge.train.data.training_data import load_for_policy
from loongforge.train.eval.policy import DEFAULT_SAMPLES, Policy
from loongforge.train.model.build import build_model
from loongforge.train.model.config import read_gr00t_dir_config
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
    batch: dict  # Policy.batch's loader-format batch, on the device
    size: int
    steps: int
    samples: int
    seed: int


class PolicyBackend:
    """A Policy behind the GR00T layout. `modality`: the embodiment's modality config as
    processor_config.json holds it ({video, state, action, language: ModalityConfig fields})."""

    def __init__(self, policy: Policy, modality: dict[str, dict], defaults: Defaults = Defaults()):
        self.policy, self.modality, self.defaults = policy, modality, defaults
        ds = policy.index.dataset
        self.k = len(policy.index.deltas.video)
        if sorted(modality["video"]["modality_keys"]) != sorted(ds.slots):
            raise ConfigError(f"modality config: video keys {modality['video']['modality_keys']}, the data root's "
                              f"cameras are {ds.slots}; give --data the shard root this checkpoint trained on")
        self.cameras = {key: ds.camera_size(ds.slots.index(key)) for key in modality["video"]["modality_keys"]}
        self.state_keys = _spans(modality, ds, "state", ds.state_dim)
        self.action_keys = _spans(modality, ds, "action", ds.action_dim)
        self.language_keys = list(modality["language"]["modality_keys"])
        policy.reference  # noqa: B018 - fitted now (reads the training episodes), not in the first request
        for kind in ("video", "state"):
            if len(modality[kind]["delta_indices"]) != self.k:
                raise ConfigError(f"modality config: {len(modality[kind]['delta_indices'])} {kind} delta indices, the "
                                  f"policy takes {self.k} frames")

    def get_modality_config(self) -> dict[str, dict]:
        return self.modality

    def reset(self, options: Any) -> dict:
        return {}  # the policy keeps no state between requests

    def prepare(self, observation: Any, options: Any) -> Prepared:
        steps, samples, seed = self._options(options)
        obs = _map(observation, "observation")
        video, state, language = (_map(obs.get(m), f"observation[{m!r}]") for m in ("video", "state", "language"))
        b = self._batch_size(video, state, language)
        for key, (h, w) in self.cameras.items():
            _array(video, key, "video", np.uint8, (b, self.k, h, w, 3), "uint8 RGB 0-255 [B, T, H, W, 3] at the "
                   "size the training data stores this camera")
        states = [_array(state, key, "state", np.float32, (b, self.k, end - start), "float32 [B, T, D], robot units")
                  for key, (start, end) in self.state_keys.items()]
        full = np.concatenate(states, axis=-1)
        if not np.isfinite(full).all():
            raise RequestError("observation['state']: NaN or infinity in the state; send finite values")
        tasks = _language(language, self.language_keys[0], b)
        observations = [{"frames": {key: video[key][i] for key in self.cameras}, "state": full[i], "task": tasks[i]}
                        for i in range(b)]
        return Prepared(self.policy.batch(observations), b, steps, samples, seed)

    def run(self, p: Prepared) -> tuple[dict[str, np.ndarray], dict]:
        with torch.inference_mode():
            out = self.policy.predict_batch(p.batch, steps=p.steps, seed=p.seed, samples=p.samples)
        action = {key: np.ascontiguousarray(out[..., start:end], dtype=np.float32)
                  for key, (start, end) in self.action_keys.items()}
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


def _spans(modality: dict, ds, kind: str, dim: int) -> dict[str, tuple[int, int]]:
    """key -> [start, end) of the data root's `kind` columns, in the modality config's key order."""
    spans, keys = groups(ds.modality, kind, dim), list(modality[kind]["modality_keys"])
    if sorted(spans) != sorted(keys):
        raise ConfigError(f"modality config: {kind} keys {keys}, the data root's modality.json groups are "
                          f"{sorted(spans)}; give --data the shard root this checkpoint trained on")
    return {k: spans[k] for k in keys}


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


def load_backend(path: str, *, data_root: str, tag: str | None = None, device: str = "cpu",
                 defaults: Defaults = Defaults()) -> PolicyBackend:
    """A run directory (its `tag`, default latest) or a `loongforge export` directory, on `device`.
    Both need, until the processor gives them their modality config, the data root they trained on."""
    if os.path.isdir(ckpt_files.ckpt_root(path)):
        return _from_run(path, data_root, tag, device, defaults)
    if os.path.exists(os.path.join(path, "config.json")):
        if tag is not None:
            raise UsageError(f"{path}: an exported directory holds one checkpoint; --step/--tag are for run "
                             "directories")
        return _from_export(path, data_root, device, defaults)
    raise UsageError(f"{path}: neither a run directory (checkpoints/) nor an exported GR00T directory (config.json)")


def _from_run(run_dir: str, data_root: str, tag: str | None, device: str, defaults: Defaults) -> PolicyBackend:
    tag = tag or ckpt_files.latest_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(run_dir)}; did training finish?")
    if not os.path.isdir(os.path.join(ckpt_files.ckpt_root(run_dir), tag)):
        raise UsageError(f"{tag}: no such checkpoint under {ckpt_files.ckpt_root(run_dir)} (latest: "
                         f"{ckpt_files.latest_tag(run_dir)})")
    policy = Policy.load(run_dir, data_root, tag=tag, device=device)
    doc = ckpt_files.read_sidecar(run_dir, tag)
    name = embodiment_tag(int(doc["embodiment_id"]))
    processor, _, _ = processor_files(doc, policy.index.dataset, name)
    return PolicyBackend(policy, processor["processor_kwargs"]["modality_configs"][name], defaults)


def _from_export(out: str, data_root: str, device: str, defaults: Defaults) -> PolicyBackend:
    try:
        with open(os.path.join(out, "processor_config.json"), encoding="utf-8") as f:
            proc_doc = json.load(f)
        with open(os.path.join(out, "embodiment_id.json"), encoding="utf-8") as f:
            (name, embodiment_id), = json.load(f).items()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{out}: not a `loongforge export` directory ({exc})") from None
    modality = proc_doc["processor_kwargs"]["modality_configs"][name]
    cfg = read_gr00t_dir_config(os.path.join(out, "config.json"))
    model = build_model(cfg)
    load_gr00t_weights(model, out)
    sidecar = {"data": {"video_deltas": modality["video"]["delta_indices"],
                        "state_deltas": modality["state"]["delta_indices"]}}
    index = load_for_policy(data_root, sidecar, cfg.action_horizon)
    policy = Policy(model, index, processor_from_gr00t_json(proc_doc), embodiment_id=int(embodiment_id),
                    tokenizer=out if has_tokenizer(out) else None, device=device)
    return PolicyBackend(policy, modality, defaults)
