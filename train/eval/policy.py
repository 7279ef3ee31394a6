"""A trained policy: checkpoint + the index's normalisation stats -> actions in dataset units.

    policy = Policy.load("runs/demo", data_root="shards")
    actions = policy.predict_action([{"frames": {"front": rgb_uint8_KxHxWx3}, "state": state_Kx44,
                                      "task": "pick"}])  # (B, H, Da); `act` is the same call

Observations are raw: frames as uint8 RGB (K, h, w, 3) or NV12 (K, 3h/2, w) per camera slot,
state (K, Ds) in dataset units, instruction text. The model sees exactly what training fed it:
the same colour conversion (the index's matrix and range), N1.6's image transform (centred crop,
as its evaluation), its min/max state normalisation, the run's tokenizer and chat template, the
run's embodiment; the output is un-normalised with the index's action min/max.

Weights: DeepSpeed ZeRO-1/2/3 checkpoints are consolidated with DeepSpeed's zero_to_fp32, ZeRO-0
ones read from the module state file; every torch.load inside is forced weights-only.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.train.ckpt import files as ckpt_files
from loongforge.train.ckpt.weights import load_weights
from loongforge.train.data.batch import Norm
from loongforge.train.data.colorspace import nv12_to_input
from loongforge.train.data.processor import Processor, ProcessorConfig
from loongforge.train.data.prompt import build_prompts, load_tokenizer
from loongforge.train.data.training_data import TrainingData, load_for_policy
from loongforge.train.eval.baselines import TrainingReference, action_groups, fit_reference, group_modes
from loongforge.train.eval.validation import predict
from loongforge.train.model.build import build_model
from loongforge.train.model.config import model_config_from
from loongforge.train.model.model import Gr00tN1d6

DEFAULT_SAMPLES = 8  # flow samples averaged per prediction (train/README.md: the K-sample mean won on validation)


class Policy:
    def __init__(self, model: Gr00tN1d6, index: TrainingData, processor: ProcessorConfig, *, embodiment_id: int,
                 tokenizer: str | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.cfg = model.cfg
        self.index, self.norm = index, Norm.from_dataset(index.dataset)
        self.processor = Processor(processor, max_state_dim=self.cfg.max_state_dim,
                                   max_action_dim=self.cfg.max_action_dim, embodiment_id=embodiment_id)
        self.tokenizer = load_tokenizer(tokenizer, self.cfg.image_token_index)

    @classmethod
    def load(cls, run_dir: str, data_root: str | None = None, *, index: TrainingData | None = None,
             tag: str | None = None, device: str | torch.device = "cpu") -> Policy:
        tag = tag or ckpt_files.latest_tag(run_dir)
        if tag is None:
            raise CheckpointError(f"no checkpoint under {ckpt_files.ckpt_root(run_dir)}; did training finish?")
        doc = ckpt_files.read_sidecar(run_dir, tag)
        model = build_model(model_config_from(doc))
        model.load_state_dict(load_weights(run_dir, tag, int(doc.get("zero_stage", 2))))
        if index is None:
            index = load_for_policy(data_root, doc, model.cfg.action_horizon)
        return cls(model, index, ProcessorConfig(**doc.get("processor", {})), embodiment_id=int(doc["embodiment_id"]),
                   tokenizer=doc.get("tokenizer"), device=device)

    @property
    def image_mean(self) -> float:
        return self.processor.cfg.image_mean

    @property
    def image_std(self) -> float:
        return self.processor.cfg.image_std

    def prompts(self, tasks: dict):
        """{task index: text} -> the PromptTable the run's tokenizer and template make of them."""
        ds, k = self.index.dataset, len(self.index.deltas.video)
        tokens = self.cfg.tokens_per_image(*self.processor.cfg.image_size)
        return build_prompts(self.tokenizer, tasks, images=len(ds.slots) * k,
                             tokens_per_image=tokens, vocab_size=self.cfg.text.vocab_size)

    def check(self, observations: list[dict]) -> None:
        """Each observation as the policy was trained: one entry per camera slot holding K frames
        of that camera's stored size (RGB (K, h, w, 3) or NV12 (K, 3h/2, w), uint8) and a (K, Ds)
        state, K = the run's video deltas. A mismatch is one ConfigError naming slot, shape, width."""
        ds, k = self.index.dataset, len(self.index.deltas.video)
        if not observations:
            raise ConfigError("predict_action: no observations")
        for n, obs in enumerate(observations):
            where = f"observation {n}"
            frames = obs.get("frames") if isinstance(obs, dict) else None
            if not isinstance(frames, dict):
                raise ConfigError(f"{where}: needs a 'frames' dict of camera slot -> frames, got {type(frames)}")
            if sorted(frames) != sorted(ds.slots):
                raise ConfigError(f"{where}: camera slots {sorted(frames)}, the policy was trained on "
                                  f"{sorted(ds.slots)}")
            for cam, slot in enumerate(ds.slots):
                h, w = ds.camera_size(cam)
                shape, dtype = tuple(np.shape(frames[slot])), np.asarray(frames[slot]).dtype
                if dtype != np.uint8:
                    raise ConfigError(f"{where}: camera {slot!r} frames are {dtype}; expected uint8 (0-255 RGB "
                                      "or NV12 bytes, as decoded from the camera)")
                if shape not in ((k, h, w, 3), (k, h * 3 // 2, w)):
                    raise ConfigError(f"{where}: camera {slot!r} frames of shape {shape}; expected RGB "
                                      f"{(k, h, w, 3)} or NV12 {(k, h * 3 // 2, w)} uint8 ({k} frame(s) per "
                                      f"sample as the run trained, {h}x{w} as the data root stores them)")
            state = np.shape(obs.get("state", ()))
            if state != (k, ds.state_dim):
                raise ConfigError(f"{where}: state of shape {state}; expected {(k, ds.state_dim)} "
                                  f"({k} row(s) of the {ds.state_dim}-D state, dataset units)")

    def batch(self, observations: list[dict]) -> dict:
        """Raw observations (same frame count each) -> a loader-format batch on the device (no actions)."""
        self.check(observations)
        ds = self.index.dataset
        frames = {}
        for slot in ds.slots:
            raw = torch.from_numpy(np.stack([np.asarray(o["frames"][slot], np.uint8) for o in observations]))
            frames[slot] = self._frames(raw.to(self.device))
        state = self.norm.state(np.stack([np.asarray(o["state"], np.float32) for o in observations]))
        table = self.prompts({i: str(o.get("task", "")) for i, o in enumerate(observations)})
        return {"frames": frames, "state": torch.from_numpy(state).to(self.device),
                "task_tokens": torch.from_numpy(table.ids[:-1]).to(self.device),
                "task_mask": torch.from_numpy(table.mask[:-1]).to(self.device)}

    def _frames(self, raw: torch.Tensor) -> torch.Tensor:
        ds = self.index.dataset
        if raw.shape[-1] == 3 and raw.ndim == 5:  # (B, K, h, w, 3) RGB
            x = raw.permute(0, 1, 4, 2, 3).float()
            return x.sub_(self.image_mean * 255.0).mul_(1.0 / (255.0 * self.image_std))
        return nv12_to_input(raw, ds.color_matrix, ds.color_range, mean=self.image_mean, std=self.image_std)

    def unnormalize(self, action: torch.Tensor | np.ndarray) -> np.ndarray:
        a = action.float().cpu().numpy() if isinstance(action, torch.Tensor) else action
        return self.norm.unaction(a)

    def unnormalize_state(self, state: torch.Tensor) -> np.ndarray:
        return self.norm.unstate(state.float().cpu().numpy())

    def sample(self, batch: dict, *, steps: int, seed: int) -> np.ndarray:
        """One flow sample of a loader-format batch -> (B, H, Da) actions in dataset units."""
        inputs = self.processor(batch, None)
        ds = self.index.dataset
        return self.unnormalize(predict(self.model, inputs, horizon=self.index.deltas.action_horizon,
                                        action_dim=ds.action_dim, steps=steps, seed=seed))

    @functools.cached_property
    def reference(self) -> TrainingReference:
        """Discrete-valued groups and their levels (and the ridge baseline), from the training episodes."""
        return fit_reference(self.index, action_groups(self.index))

    def predict_action(self, observations: list[dict], *, steps: int | None = None, seed: int = 0,
                       samples: int = DEFAULT_SAMPLES, modes: str | dict | None = None) -> np.ndarray:
        """(B, H, Da) actions in dataset units: the mean of `samples` flow integrations (noise seeds
        seed..seed+samples-1; N1.6's 4 Euler steps unless `steps`). `modes` picks, per discrete-valued
        group, "flow" (as the flow gives it) or "snap" (nearest training level): one name for all such
        groups or a dict group -> mode (baselines.group_modes).
        Observations are checked first (`check`): slot names, frame shapes, state width."""
        steps = steps or self.cfg.num_inference_timesteps
        if steps < 1 or samples < 1:
            raise ConfigError(f"steps={steps}, samples={samples}: the flow needs at least 1 integration step "
                              "and 1 sample")
        return self.predict_batch(self.batch(observations), steps=steps, seed=seed, samples=samples, modes=modes)

    def predict_batch(self, batch: dict, *, steps: int, seed: int = 0, samples: int = DEFAULT_SAMPLES,
                      modes: str | dict | None = None) -> np.ndarray:
        """predict_action of a batch already made by `batch` (the policy server times the two apart)."""
        out = np.mean([self.sample(batch, steps=steps, seed=seed + j) for j in range(samples)], axis=0)
        return self.apply_modes(out, modes)

    def apply_modes(self, out: np.ndarray, modes: str | dict | None) -> np.ndarray:
        """`out` (dataset units) with each discrete-valued group as its mode asks."""
        ref = self.reference
        groups = action_groups(self.index)
        snap = [d for g, mode in group_modes(ref, modes).items() if mode == "snap" for d in range(*groups[g])]
        return ref.snap(out, snap) if snap else out

    act = predict_action  # the earlier name
