"""GR00T N1.6's processor: the one place that turns a sample into the model's inputs and the model's
output back into robot actions, for training, `loongforge inspect`, evaluation, export, serving and
simulation alike (Isaac-GR00T's Gr00tN1d6Processor + collator + decode_action).

  Processor.embodiments   per embodiment tag: its modality config and statistics -> StateAction
                          (state_action.py: per-key normalisation, sin/cos, relative actions, decode)
  Processor.__call__      a batch (the loader's, or `observation`'s) -> model inputs, on its device:
                          pixel values (below), prompt ids, state and action zero-padded to
                          max_state_dim / max_action_dim and the action to max_action_horizon steps,
                          the action mask (1 on real steps and dims of good samples), embodiment ids
  Processor.observation   GR00T's observation layout ({"video": {key: (B, T, H, W, 3) uint8}, "state":
                          {key: (B, T, D)}, "language": {key: [text] * B}}) -> a batch + the raw state
  Processor.decode        model output (B, >= H, >= Da) -> {action key: (B, H, D)} in robot units
  Processor.to_json / gr00t_files   the sidecar record; Isaac-GR00T's processor_config.json,
                          statistics.json and embodiment_id.json

Images (every camera and frame of a sample is one image, frame-major then camera in the modality
config's video order), each as N1.6 transforms it (LetterBoxPad, SmallestMaxSize(edge),
FractionalRandomCrop(fraction) + ColorJitter in training / FractionalCenterCrop at evaluation,
SmallestMaxSize(edge), then Eagle's smart_resize to a multiple of 28): images.py's device path, the
resizes as the weight matrices OpenCV and Pillow define (two matmuls per camera and size), within
about a level of Isaac-GR00T's uint8 pixels (images.py's reference path is bit-exact). The crop and
jitter are drawn per sample (every image of a sample shares them: `draws`). Pixel values are
normalized (x - 0.5) / 0.5 (Eagle's processor); the loader delivers them normalized with the same
mean and std, and letterbox black is that normalization's 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from loongforge.shared import embodiment as emb
from loongforge.shared.errors import ConfigError
from loongforge.train.data.images import ColorJitter, Geometry, ImageDraws, device_images, image_draws
from loongforge.train.data.prompt import formalize
from loongforge.train.data.state_action import StateAction, StateActionOptions

IMAGE_FACTOR = 28  # Eagle: patch 14 x pixel unshuffle 2
MIN_PIXELS, MAX_PIXELS, MAX_SIDE = 4 * 28 * 28, 4096 * 28 * 28, 500 * 14  # Eagle's smart_resize bounds
N16_JITTER = (0.3, 0.4, 0.5, 0.08)  # brightness, contrast, saturation, hue of the default N1.6 fine-tune


def smart_resize(h: int, w: int, factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """Eagle's smart_resize: both sides a multiple of `factor`, pixels within its bounds."""
    hb = min(max(factor, round(h / factor) * factor), MAX_SIDE)
    wb = min(max(factor, round(w / factor) * factor), MAX_SIDE)
    if hb * wb > MAX_PIXELS:
        beta = math.sqrt(hb * wb / MAX_PIXELS)
        hb, wb = math.floor(hb / beta / factor) * factor, math.floor(wb / beta / factor) * factor
    elif hb * wb < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessorConfig:
    """N1.6's processor settings (its processor_config.json's processor_kwargs), defaults the N1.6 fine-tune's."""

    image_edge: int = 256  # shortest_image_edge: SmallestMaxSize before and after the crop
    crop_fraction: float = 0.95
    image_mean: float = 0.5  # Eagle: rescale 1/255, then (x - 0.5) / 0.5
    image_std: float = 0.5
    color_jitter: tuple[float, float, float, float] | None = N16_JITTER  # training only; None = off
    use_percentiles: bool = False
    clip_outliers: bool = True
    apply_sincos_state_encoding: bool = True
    use_relative_action: bool = True
    formalize_language: bool = True

    def __post_init__(self):
        if self.image_edge < IMAGE_FACTOR:
            raise ConfigError(f"processor.image_edge={self.image_edge}: must be >= {IMAGE_FACTOR}")
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ConfigError(f"processor.crop_fraction={self.crop_fraction}: must be in (0, 1]")
        if self.color_jitter is not None and (len(self.color_jitter) != 4 or min(self.color_jitter) < 0):
            raise ConfigError(f"processor.color_jitter={self.color_jitter}: four non-negative values (brightness, "
                              "contrast, saturation, hue)")

    @property
    def crop(self) -> int:
        return max(1, int(self.image_edge * self.crop_fraction))

    @property
    def image_size(self) -> tuple[int, int]:
        return smart_resize(self.image_edge, self.image_edge)

    @property
    def geometry(self) -> Geometry:
        return Geometry(edge=self.image_edge, crop=self.crop, size=self.image_size)

    @property
    def jitter(self) -> ColorJitter | None:
        return None if self.color_jitter is None else ColorJitter(*self.color_jitter)

    @property
    def options(self) -> StateActionOptions:
        return StateActionOptions(use_percentiles=self.use_percentiles, clip_outliers=self.clip_outliers,
                                  apply_sincos_state_encoding=self.apply_sincos_state_encoding,
                                  use_relative_action=self.use_relative_action)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["color_jitter"] = None if self.color_jitter is None else list(self.color_jitter)
        return out

    @classmethod
    def from_dict(cls, doc: dict) -> "ProcessorConfig":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in doc.items() if k in known}
        if kw.get("color_jitter") is not None:
            kw["color_jitter"] = tuple(float(v) for v in kw["color_jitter"])
        return cls(**kw)


def processor_from_gr00t_json(doc: dict) -> ProcessorConfig:
    """Isaac-GR00T's processor_config.json -> ProcessorConfig (its settings; the defaults where absent)."""
    kw = doc.get("processor_kwargs", doc)
    out: dict = {}
    if kw.get("shortest_image_edge"):
        out["image_edge"] = int(kw["shortest_image_edge"])
    if kw.get("crop_fraction"):
        out["crop_fraction"] = float(kw["crop_fraction"])
    jitter = kw.get("color_jitter_params")
    if isinstance(jitter, dict):
        out["color_jitter"] = tuple(float(jitter.get(k, 0.0)) for k in ("brightness", "contrast", "saturation", "hue"))
    for name in ("use_percentiles", "clip_outliers", "apply_sincos_state_encoding", "use_relative_action",
                 "formalize_language"):
        if isinstance(kw.get(name), bool):
            out[name] = kw[name]
    return ProcessorConfig(**out)


@dataclass(frozen=True)
class Embodiment:
    """One tag the processor serves: projector index, modality config and the statistics it normalises with."""

    tag: str
    projector: int
    config: emb.EmbodimentConfig
    statistics: dict

    def to_json(self) -> dict:
        return {"projector": self.projector, "config": self.config.to_json(), "statistics": self.statistics}

    @classmethod
    def from_json(cls, tag: str, doc: dict) -> "Embodiment":
        return cls(tag, int(doc["projector"]), emb.EmbodimentConfig.from_json(doc["config"], f"embodiment {tag}"),
                   doc["statistics"])


class Processor:
    def __init__(self, cfg: ProcessorConfig, embodiments: dict[str, Embodiment], *, max_state_dim: int,
                 max_action_dim: int, max_action_horizon: int):
        if not embodiments:
            raise ConfigError("processor: no embodiment")
        self.cfg, self.embodiments = cfg, dict(embodiments)
        self.max_state_dim, self.max_action_dim, self.max_action_horizon = max_state_dim, max_action_dim, \
            max_action_horizon
        self.sa = {t: StateAction(e.config, e.statistics, cfg.options, tag=t) for t, e in self.embodiments.items()}
        for t, sa in self.sa.items():
            if sa.state_dim > max_state_dim or sa.action_dim > max_action_dim or sa.horizon > max_action_horizon:
                raise ConfigError(f"embodiment {t}: {sa.state_dim}-D state, {sa.action_dim}-D action over {sa.horizon} "
                                  f"steps; the model takes at most {max_state_dim} / {max_action_dim} / "
                                  f"{max_action_horizon} (max_state_dim / max_action_dim / action_horizon)")

    @property
    def tag(self) -> str:
        """The only tag (most runs train one embodiment)."""
        if len(self.embodiments) != 1:
            raise ConfigError(f"the run has embodiments {sorted(self.embodiments)}: name one")
        return next(iter(self.embodiments))

    def state_action(self, tag: str | None = None) -> StateAction:
        tag = tag or self.tag
        if tag not in self.sa:
            raise ConfigError(f"embodiment {tag!r}: this policy was trained on {sorted(self.sa)}")
        return self.sa[tag]

    # ---- records ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"config": self.cfg.to_dict(), "max_state_dim": self.max_state_dim,
                "max_action_dim": self.max_action_dim, "max_action_horizon": self.max_action_horizon,
                "embodiments": {t: e.to_json() for t, e in self.embodiments.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> "Processor":
        return cls(ProcessorConfig.from_dict(doc.get("config", {})),
                   {t: Embodiment.from_json(t, e) for t, e in doc["embodiments"].items()},
                   max_state_dim=int(doc["max_state_dim"]), max_action_dim=int(doc["max_action_dim"]),
                   max_action_horizon=int(doc["max_action_horizon"]))

    @classmethod
    def from_gr00t_files(cls, processor_config: dict, statistics: dict, embodiment_ids: dict) -> "Processor":
        """Isaac-GR00T's processor files (an export, a released checkpoint) -> the processor they describe:
        every tag with both a modality config and statistics."""
        kw = processor_config.get("processor_kwargs", processor_config)
        configs = kw.get("modality_configs") or {}
        tags = [t for t in configs if t in statistics]
        if not tags:
            raise ConfigError(f"processor files: no embodiment has both a modality config ({sorted(configs)}) and "
                              f"statistics ({sorted(statistics)})")
        embodiments = {t: Embodiment(t, int(embodiment_ids.get(t, emb.projector_index(t))),
                                     emb.EmbodimentConfig.from_json(configs[t], f"processor_config.json: {t}"),
                                     {k: statistics[t].get(k, {}) for k in ("state", "action", "relative_action")})
                       for t in tags}
        return cls(processor_from_gr00t_json(processor_config), embodiments, max_state_dim=int(kw["max_state_dim"]),
                   max_action_dim=int(kw["max_action_dim"]), max_action_horizon=int(kw["max_action_horizon"]))

    def gr00t_files(self) -> tuple[dict, dict, dict]:
        """(processor_config.json, statistics.json, embodiment_id.json) as Isaac-GR00T's processor writes them."""
        c = self.cfg
        jitter = None if c.color_jitter is None else dict(zip(("brightness", "contrast", "saturation", "hue"),
                                                              c.color_jitter))
        kwargs = {"modality_configs": {t: e.config.to_json() for t, e in self.embodiments.items()},
                  "image_crop_size": None, "image_target_size": None, "use_albumentations": True,
                  "random_rotation_angle": None, "color_jitter_params": jitter, "shortest_image_edge": c.image_edge,
                  "crop_fraction": c.crop_fraction, "model_name": "nvidia/Eagle-Block2A-2B-v2", "model_type": "eagle",
                  "formalize_language": c.formalize_language, "max_state_dim": self.max_state_dim,
                  "max_action_dim": self.max_action_dim, "max_action_horizon": self.max_action_horizon,
                  "use_percentiles": c.use_percentiles, "clip_outliers": c.clip_outliers,
                  "apply_sincos_state_encoding": c.apply_sincos_state_encoding,
                  "use_relative_action": c.use_relative_action}
        stats = {t: {k: e.statistics.get(k, {}) for k in ("state", "action", "relative_action")}
                 for t, e in self.embodiments.items()}
        return ({"processor_class": "Gr00tN1d6Processor", "processor_kwargs": kwargs}, stats,
                {t: e.projector for t, e in self.embodiments.items()})

    # ---- model inputs (on the batch's device) -------------------------------------------------------
    def draws(self, seed: int, epoch: int, sample_ids, stream: int = 0) -> ImageDraws:
        """The training crop and colour jitter of `sample_ids`: a function of (seed, epoch, sample id) only."""
        return image_draws(seed, epoch, sample_ids, self.cfg.geometry, self.cfg.jitter, stream)

    def __call__(self, batch: dict, tag: str | None = None, cameras=None, crop_u: torch.Tensor | None = None,
                 draws: ImageDraws | None = None) -> dict:
        """A batch (the loader's, or `observation`'s; no "action" at inference) -> the model's inputs.
        `cameras`: the frame fields in the modality config's video order (default: sorted); `draws`
        (`self.draws`, a row per sample) the training crop and colour jitter, or `crop_u` (B, 2) uniforms
        the crop alone; neither: the centred crop of evaluation."""
        sa = self.state_action(tag)
        state = batch["state"]
        if state.shape[-1] != sa.state_dim:
            raise ConfigError(f"embodiment {sa.tag}: a {state.shape[-1]}-D processed state, expected {sa.state_dim}")
        order = list(cameras) if cameras is not None else sorted(batch["frames"])
        out = {"pixel_values": self.images(batch["frames"], order, crop_u, draws),
               "input_ids": batch["task_tokens"], "attention_mask": batch["task_mask"],
               "state": F.pad(state.float(), (0, self.max_state_dim - state.shape[-1])),
               "embodiment_id": torch.full((state.shape[0],), self.embodiments[sa.tag].projector, dtype=torch.long,
                                           device=state.device)}
        if "action" in batch:
            action = batch["action"]
            h, da = action.shape[-2:]
            if da != sa.action_dim or h > self.max_action_horizon:
                raise ConfigError(f"embodiment {sa.tag}: action chunks of {h} x {da}, expected at most "
                                  f"{self.max_action_horizon} x {sa.action_dim}")
            dims = torch.arange(self.max_action_dim, device=action.device) < da
            rows = batch["action_valid"] & batch["sample_valid"][:, None]
            pad = (0, self.max_action_dim - da, 0, self.max_action_horizon - h)
            out["action"] = F.pad(action.float(), pad)
            out["action_mask"] = F.pad((rows[:, :, None] & dims[None, None]).float(), (0, 0, 0, pad[3]))
        return out

    def images(self, frames: dict, order: list, crop_u: torch.Tensor | None = None,
               draws: ImageDraws | None = None) -> torch.Tensor:
        """{camera: (B, K, 3, h, w)} normalized, each camera its own size -> (B*K*V, 3, H, W), frame-major
        then camera in `order`."""
        c = self.cfg
        geo = c.geometry
        units = (-c.image_mean / c.image_std, (1.0 - c.image_mean) / c.image_std)  # levels 0 and 255
        out = []
        for cam in order:
            x = frames[cam]
            b, k = x.shape[:2]
            offsets = None
            if draws is None and crop_u is not None:
                offs = (crop_u.to(x.device).float() * geo.offsets).long().clamp_(0, geo.offsets - 1)
                offs = offs.repeat_interleave(k, dim=0)
                offsets = (offs[:, 1], offs[:, 0])
            y = device_images(x.flatten(0, 1), geo, draws=None if draws is None else draws.per_image(k),
                              offsets=offsets, units=units)
            out.append(y.view(b, k, *y.shape[1:]))
        return torch.stack(out, dim=2).flatten(0, 2)  # (B, K, V, ...): frame-major, then camera

    # ---- GR00T's observation layout ----------------------------------------------------------------
    def check_observation(self, obs: dict, tag: str | None = None) -> int:
        """The batch size of a GR00T-layout observation; ConfigError naming the key and the shape expected."""
        sa = self.state_action(tag)
        cfg = sa.config
        if not isinstance(obs, dict):
            raise ConfigError(f"observation: a dict of video/state/language was expected, got {type(obs).__name__}")
        b = None
        for key in cfg.video.modality_keys:
            v = (obs.get("video") or {}).get(key)
            if v is None:
                raise ConfigError(f"observation: video[{key!r}] missing; expected uint8 [B, "
                                  f"{len(cfg.video.delta_indices)}, H, W, 3] for each of {list(cfg.video.modality_keys)}")
            v = np.asarray(v)
            if v.dtype != np.uint8 or v.ndim != 5 or v.shape[1] != len(cfg.video.delta_indices) or v.shape[-1] != 3:
                raise ConfigError(f"observation: video[{key!r}] is {v.dtype} {list(v.shape)}; expected uint8 [B, "
                                  f"{len(cfg.video.delta_indices)}, H, W, 3]")
            b = v.shape[0] if b is None else b
            if v.shape[0] != b:
                raise ConfigError(f"observation: video[{key!r}] has batch {v.shape[0]}, another key {b}")
        for key, d in sa.state_dims.items():
            s = (obs.get("state") or {}).get(key)
            want = f"float [B, {len(cfg.state.delta_indices)}, {d}]"
            if s is None:
                raise ConfigError(f"observation: state[{key!r}] missing; expected {want}")
            s = np.asarray(s)
            if s.ndim != 3 or s.shape[1:] != (len(cfg.state.delta_indices), d) or s.shape[0] != b or \
                    not np.issubdtype(s.dtype, np.number):
                raise ConfigError(f"observation: state[{key!r}] is {s.dtype} {list(s.shape)}; expected {want}")
        lang = cfg.language.modality_keys[0]
        texts = (obs.get("language") or {}).get(lang)
        if texts is None or len(np.atleast_1d(np.asarray(texts, dtype=object)).reshape(-1)) != b:
            raise ConfigError(f"observation: language[{lang!r}] missing or not {b} strings")
        return int(b)

    def observation(self, obs: dict, tag: str | None, device, prompts) -> tuple[dict, dict]:
        """GR00T's observation -> (a batch for __call__, the raw state {key: (B, K, D)} for decode).
        `prompts(texts) -> (ids, mask)` tokenizes the formalized instructions through the chat template."""
        sa = self.state_action(tag)
        self.check_observation(obs, tag)
        cfg = sa.config
        mean, std = self.cfg.image_mean, self.cfg.image_std
        frames = {}
        for key in cfg.video.modality_keys:
            arr = np.ascontiguousarray(obs["video"][key])
            if not arr.flags.writeable:  # a received buffer (serve's msgpack): torch views only writable memory
                arr = arr.copy()
            raw = torch.from_numpy(arr).to(device)  # (B, T, H, W, 3)
            frames[key] = raw.permute(0, 1, 4, 2, 3).float().sub_(mean * 255.0).mul_(1.0 / (255.0 * std))
        raw_state = {k: np.asarray(obs["state"][k], np.float32) for k in cfg.state.modality_keys}
        state = torch.from_numpy(sa.state(raw_state)).to(device)
        texts = [str(t) for t in np.asarray(obs["language"][cfg.language.modality_keys[0]], dtype=object).reshape(-1)]
        if self.cfg.formalize_language:
            texts = [formalize(t) for t in texts]
        ids, mask = prompts(texts)
        return {"frames": frames, "state": state, "task_tokens": ids.to(device), "task_mask": mask.to(device)}, \
            raw_state

    def decode(self, action, raw_state: dict, tag: str | None = None) -> dict:
        """Model output (B, >= H, >= Da), normalized -> {action key: (B, H, D) float32} in robot units."""
        a = action.float().cpu().numpy() if isinstance(action, torch.Tensor) else np.asarray(action)
        return {k: v.astype(np.float32) for k, v in self.state_action(tag).decode(a, raw_state).items()}
