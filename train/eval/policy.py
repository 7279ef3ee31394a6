"""A trained policy: checkpoint + the run's N1.6 processor -> actions in the robot's units.

    policy = Policy.load("runs/demo")                         # the run's processor is in its checkpoint
    actions = policy.predict_action({"video": {"front": rgb_B_T_H_W_3}, "state": {"arm": s_B_T_D, ...},
                                     "language": {"annotation.human.task_description": ["pick"] * B}})
    # {action key: (B, H, D)} in robot units: relative keys already made absolute

The observation is Isaac-GR00T's layout (Gr00tPolicy.get_action's): per video key uint8 RGB
[B, T, H, W, 3], per state key [B, T, D] in robot units, the instruction per language key. The model
sees exactly what training fed it (processor.py: N1.6's image transform with its centred crop, the
per-key state normalisation and sin/cos, the run's tokenizer and chat template, the embodiment's
projector); the output is decoded per key (unnormalised, relative actions made absolute from the
observation's state). The older form, a list of {"frames": {slot: (K, h, w, 3) RGB or (K, 3h/2, w)
NV12}, "state": (K, Ds), "task": str}, is still taken and gives the concatenated (B, H, Da) chunk.

Weights: DeepSpeed ZeRO-1/2/3 checkpoints are consolidated with DeepSpeed's zero_to_fp32, ZeRO-0
ones read from the module state file; every torch.load inside is forced weights-only.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import torch
from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.gr00t import load_gr00t_weights
from loongforge.train.ckpt.weights import load_weights
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.processor import Processor
from loongforge.train.data.prompt import build_prompts, chat_text, formalize, has_tokenizer, load_tokenizer
from loongforge.train.data.training_data import TrainingData, load_for_policy
from loongforge.train.eval.baselines import TrainingReference, action_groups, fit_reference, group_modes
from loongforge.train.eval.validation import sample_flow
from loongforge.train.model.build import build_model
from loongforge.train.model.config import model_config_from, read_gr00t_dir_config
from loongforge.train.model.model import Gr00tN1d6

DEFAULT_SAMPLES = 8  # flow samples averaged per prediction (train/README.md: the K-sample mean won on validation)


class Policy:
    def __init__(self, model: Gr00tN1d6, processor: Processor, *, tokenizer: str | None = None,
                 device: str | torch.device = "cpu", index: TrainingData | None = None, cameras: dict | None = None):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.cfg = model.cfg
        self.processor, self.index = processor, index
        self.cameras = cameras or {}  # tag -> {video key: camera slot} of the data the run trained on
        self.tokenizer = load_tokenizer(tokenizer, self.cfg.image_token_index)

    @classmethod
    def load(cls, run_dir: str, data_root: str | None = None, *, index: TrainingData | None = None,
             tag: str | None = None, device: str | torch.device = "cpu") -> Policy:
        tag = tag or ckpt_files.latest_tag(run_dir)
        if tag is None:
            raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(run_dir)}; did training finish?")
        doc = ckpt_files.read_sidecar(run_dir, tag)
        if "gr00t_processor" not in doc:
            raise CheckpointError(f"{run_dir}: checkpoint {tag} was written before the N1.6 processor was recorded "
                                  "in it; retrain it with this version")
        model = build_model(model_config_from(doc))
        model.load_state_dict(load_weights(run_dir, tag, int(doc.get("zero_stage", 2))))
        if index is None and data_root is not None:
            index = load_for_policy(data_root, doc, model.cfg.action_horizon)
        return cls(model, Processor.from_json(doc["gr00t_processor"]), tokenizer=doc.get("tokenizer"), device=device,
                   index=index, cameras=doc.get("data", {}).get("cameras"))

    @classmethod
    def from_export(cls, path: str, *, device: str | torch.device = "cpu") -> Policy:
        """An Isaac-GR00T N1.6 checkpoint directory (`loongforge export`'s, or one Isaac-GR00T wrote):
        config.json + safetensors + its processor files (processor_config.json, statistics.json,
        embodiment_id.json) and tokenizer files."""
        docs = {}
        for name in ("processor_config.json", "statistics.json", "embodiment_id.json"):
            try:
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    docs[name] = json.load(f)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path}: {name} is missing or unreadable ({exc}); an exported directory holds "
                                      "the processor files `loongforge export` writes") from None
        processor = Processor.from_gr00t_files(docs["processor_config.json"], docs["statistics.json"],
                                               docs["embodiment_id.json"])
        model = build_model(read_gr00t_dir_config(os.path.join(path, "config.json")))
        load_gr00t_weights(model, path)
        return cls(model, processor, tokenizer=path if has_tokenizer(path) else None, device=device)

    @property
    def image_mean(self) -> float:
        return self.processor.cfg.image_mean

    @property
    def image_std(self) -> float:
        return self.processor.cfg.image_std

    def tag(self, tag: str | None = None) -> str:
        return tag or self.processor.tag

    def modality_config(self, tag: str | None = None) -> dict:
        """The embodiment's modality config (Isaac-GR00T's JSON form): the keys an observation needs."""
        return self.processor.state_action(self.tag(tag)).config.to_json()

    # ---- prompts -------------------------------------------------------------------------------------
    def _images_per_sample(self, tag: str) -> int:
        c = self.processor.state_action(tag).config
        return len(c.video.modality_keys) * len(c.video.delta_indices)

    def prompts(self, tasks: dict, tag: str | None = None):
        """{task index: text} -> the PromptTable the run's tokenizer and template make of them."""
        tokens = self.cfg.tokens_per_image(*self.processor.cfg.image_size)
        return build_prompts(self.tokenizer, tasks, images=self._images_per_sample(self.tag(tag)),
                             tokens_per_image=tokens, vocab_size=self.cfg.text.vocab_size)

    def prompt_encoder(self, tag: str):
        """texts (formalized) -> (ids, mask) left-padded tensors: the run's tokenizer and chat template with
        the embodiment's image tokens (what processor.observation takes)."""
        return self._tokenize(tag)

    def _tokenize(self, tag: str):
        tokens = self.cfg.tokens_per_image(*self.processor.cfg.image_size)
        images = self._images_per_sample(tag)

        def encode(texts: list[str]):  # already formalized by the processor
            rows = [self.tokenizer.encode(chat_text(t, images, tokens)) for t in texts]
            n = max(len(r) for r in rows)
            ids = np.full((len(rows), n), self.tokenizer.pad_token_id, np.int64)
            mask = np.zeros((len(rows), n), bool)
            for i, r in enumerate(rows):
                ids[i, n - len(r):], mask[i, n - len(r):] = r, True  # left padding, as the collator
            return torch.from_numpy(ids), torch.from_numpy(mask)
        return encode

    # ---- actions --------------------------------------------------------------------------------------
    def get_action(self, observation: dict, *, tag: str | None = None, steps: int | None = None, seed: int = 0,
                   samples: int = DEFAULT_SAMPLES) -> dict:
        """GR00T's observation -> {action key: (B, H, D) float32}, robot units: the mean of `samples` flow
        integrations (noise seeds seed..seed+samples-1; N1.6's 4 Euler steps unless `steps`)."""
        tag = self.tag(tag)
        steps, samples = self._check_flow(steps, samples)
        batch, raw_state = self.processor.observation(observation, tag, self.device, self._tokenize(tag))
        cameras = self.processor.state_action(tag).config.video.modality_keys
        normalized = self.flow(batch, tag, cameras, steps, seed, samples)
        return self.processor.decode(normalized, raw_state, tag)

    def _check_flow(self, steps, samples) -> tuple[int, int]:
        steps = steps or self.cfg.num_inference_timesteps
        if steps < 1 or samples < 1:
            raise ConfigError(f"steps={steps}, samples={samples}: the flow needs at least 1 integration step "
                              "and 1 sample")
        return steps, samples

    def flows(self, batch: dict, tag: str, cameras, steps: int, seed: int, samples: int) -> np.ndarray:
        """(samples, B, H, Da): the normalized flow output of a batch for seeds seed..seed+samples-1. The
        backbone runs once; each seed integrates the action head from its own noise (the same actions
        as `predict`, which encodes per call)."""
        sa = self.processor.state_action(tag)
        inputs = self.processor(batch, tag, cameras, None)  # centred crop, no jitter: N1.6's evaluation
        with torch.no_grad():
            cond = self.model.encode(inputs)
        return np.stack([sample_flow(self.model, cond, inputs, horizon=self.processor.max_action_horizon,
                                     action_dim=sa.action_dim, steps=steps,
                                     seed=seed + j)[:, :sa.horizon].float().cpu().numpy() for j in range(samples)])

    def flow(self, batch: dict, tag: str, cameras, steps: int, seed: int, samples: int) -> np.ndarray:
        """The K-sample mean, in the model's units (decoded once after: a relative key's mean chunk is
        made absolute, and clipping applies to the mean, as a robot gets it)."""
        return self.flows(batch, tag, cameras, steps, seed, samples).mean(axis=0)

    def decode_concat(self, normalized, raw_state, tag: str | None = None) -> np.ndarray:
        """Normalized (B, H, Da) -> (B, H, Da) robot units, keys concatenated in config order; raw_state
        (B, K, raw state dims concatenated in key order)."""
        sa = self.processor.state_action(self.tag(tag))
        raw = raw_state.float().cpu().numpy() if isinstance(raw_state, torch.Tensor) else np.asarray(raw_state)
        out = sa.decode(np.asarray(normalized), sa.split_state(raw))
        return sa.concat(out).astype(np.float32)

    @functools.cached_property
    def reference(self) -> TrainingReference:
        """Discrete-valued groups and their levels (and the ridge baseline), from the training episodes."""
        if self.index is None:
            raise ConfigError("the training reference (discrete levels, ridge) needs the data root: "
                              "Policy.load(run_dir, data_root)")
        return fit_reference(self.index, action_groups(self.index), self.processor)

    def predict_action(self, observations, *, steps: int | None = None, seed: int = 0,
                       samples: int = DEFAULT_SAMPLES, modes: str | dict | None = None, tag: str | None = None):
        """GR00T's observation dict -> {action key: (B, H, D)} (get_action); the older list of
        {"frames", "state", "task"} -> (B, H, Da) concatenated in key order. `modes` (the list form, with
        the data root) picks per discrete-valued group "flow" or "snap" (nearest training level)."""
        if isinstance(observations, dict):
            return self.get_action(observations, tag=tag, steps=steps, seed=seed, samples=samples)
        tag = self.tag(tag)
        steps, samples = self._check_flow(steps, samples)
        batch, raw = self.batch(observations, tag)
        out = self.decode_concat(self.flow(batch, tag, self._keys(tag), steps, seed, samples), raw, tag)
        return self.apply_modes(out, modes) if modes is not None else out

    def _keys(self, tag: str) -> list[str]:
        return list(self.processor.state_action(tag).config.video.modality_keys)

    def _slot(self, tag: str, key: str) -> str:
        return (self.cameras.get(tag) or {}).get(key, key)

    def check(self, observations: list[dict], tag: str | None = None) -> None:
        """The older form, each observation as the policy was trained: one entry per camera (its slot or
        video key) holding K frames (RGB (K, h, w, 3) or NV12 (K, 3h/2, w), uint8) and a (K, Ds) raw state
        concatenated in key order. A mismatch is one ConfigError naming camera, shape, width."""
        tag = self.tag(tag)
        sa = self.processor.state_action(tag)
        k = len(sa.config.video.delta_indices)
        if not observations:
            raise ConfigError("predict_action: no observations")
        for n, obs in enumerate(observations):
            where = f"observation {n}"
            frames = obs.get("frames") if isinstance(obs, dict) else None
            if not isinstance(frames, dict):
                raise ConfigError(f"{where}: needs a 'frames' dict of camera -> frames, got {type(frames)}")
            for key in self._keys(tag):
                got = frames.get(self._slot(tag, key), frames.get(key))
                if got is None:
                    raise ConfigError(f"{where}: camera {self._slot(tag, key)!r} missing; the policy was trained on "
                                      f"{[self._slot(tag, c) for c in self._keys(tag)]}")
                arr = np.asarray(got)
                if arr.dtype != np.uint8 or arr.ndim not in (3, 4) or arr.shape[0] != k or \
                        (arr.ndim == 4 and arr.shape[-1] != 3):
                    raise ConfigError(f"{where}: camera {self._slot(tag, key)!r} frames are {arr.dtype} "
                                      f"{tuple(arr.shape)}; expected uint8 RGB ({k}, h, w, 3) or NV12 ({k}, 3h/2, w)")
            state = np.shape(obs.get("state", ()))
            if state != (len(sa.config.state.delta_indices), sa.raw_state_dim):
                raise ConfigError(f"{where}: state of shape {state}; expected "
                                  f"{(len(sa.config.state.delta_indices), sa.raw_state_dim)} (the raw state keys "
                                  f"{list(sa.state_dims)} concatenated, robot units)")

    def batch(self, observations: list[dict], tag: str | None = None) -> tuple[dict, np.ndarray]:
        """Older-form observations -> (a batch on the device, the raw state (B, K, Ds))."""
        tag = self.tag(tag)
        self.check(observations, tag)
        sa = self.processor.state_action(tag)
        frames = {}
        for key in self._keys(tag):
            raw = np.stack([np.asarray(o["frames"].get(self._slot(tag, key), o["frames"].get(key)), np.uint8)
                            for o in observations])
            frames[key] = self._frames(torch.from_numpy(raw).to(self.device))
        raw_state = np.stack([np.asarray(o["state"], np.float32) for o in observations])
        state = sa.state(sa.split_state(raw_state))
        encode = self._tokenize(tag)
        texts = [str(o.get("task", "")) for o in observations]
        ids, mask = encode([self._formal(t) for t in texts])
        return {"frames": frames, "state": torch.from_numpy(state).to(self.device),
                "task_tokens": ids.to(self.device), "task_mask": mask.to(self.device)}, raw_state

    def _formal(self, text: str) -> str:
        return formalize(text) if self.processor.cfg.formalize_language else text

    def _frames(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.shape[-1] == 3 and raw.ndim == 5:  # (B, K, h, w, 3) RGB
            x = raw.permute(0, 1, 4, 2, 3).float()
            return x.sub_(self.image_mean * 255.0).mul_(1.0 / (255.0 * self.image_std))
        info = self.index.dataset if self.index is not None else None
        if info is None:
            raise ConfigError("NV12 frames need the data root's colour (Policy.load(run_dir, data_root)); give RGB")
        return nv12_to_input(raw, info.color_matrix, info.color_range, mean=self.image_mean, std=self.image_std)

    def apply_modes(self, out: np.ndarray, modes: str | dict | None) -> np.ndarray:
        """`out` (robot units) with each discrete-valued group as its mode asks."""
        ref = self.reference
        groups = action_groups(self.index)
        snap = [d for g, mode in group_modes(ref, modes).items() if mode == "snap" for d in range(*groups[g])]
        return ref.snap(out, snap) if snap else out

    act = predict_action  # the earlier name
