"""A loader batch -> N1.6's model inputs, on the training device: what Isaac-GR00T's
Gr00tN1d6Processor + collator do on the CPU per sample, done here once per batch on tensors.

Images (every camera and frame of a sample is one image, frame-major then camera in the modality
config's order, as the reference stacks them), each as N1.6 transforms it (LetterBoxPad,
SmallestMaxSize(edge), FractionalRandomCrop(fraction) + ColorJitter in training /
FractionalCenterCrop at evaluation, SmallestMaxSize(edge), then Eagle's smart_resize to a multiple
of 28 pixels): images.py's device path, the resizes as the weight matrices OpenCV and Pillow
define (two matmuls per camera), within about a level of Isaac-GR00T's uint8 pixels. Pixel values
are normalized (x - 0.5) / 0.5 (Eagle's processor); the loader delivers them normalized with the
same mean and std, and letterbox black is that normalization's 0.

State (B, K, Ds) and action (B, H, Da), already normalized by the filler (min/max to [-1, 1], as
N1.6), are zero-padded to max_state_dim / max_action_dim; the action mask is 1 on real rows of good
samples and real dimensions. The prompt ids come from the loader (prompt.py's table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from loongforge.shared.errors import ConfigError
from loongforge.train.data.images import Geometry, ImageDraws, device_images

IMAGE_FACTOR = 28  # Eagle: patch 14 x pixel unshuffle 2
MIN_PIXELS, MAX_PIXELS, MAX_SIDE = 4 * 28 * 28, 4096 * 28 * 28, 500 * 14  # Eagle's smart_resize bounds


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
    """N1.6's image processing (its processor_config.json: shortest_image_edge, crop_fraction)."""

    image_edge: int = 256  # SmallestMaxSize before and after the crop
    crop_fraction: float = 0.95
    image_mean: float = 0.5  # Eagle: rescale 1/255, then (x - 0.5) / 0.5
    image_std: float = 0.5

    def __post_init__(self):
        if self.image_edge < IMAGE_FACTOR:
            raise ConfigError(f"processor.image_edge={self.image_edge}: must be >= {IMAGE_FACTOR}")
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ConfigError(f"processor.crop_fraction={self.crop_fraction}: must be in (0, 1]")

    @property
    def crop(self) -> int:
        return max(1, int(self.image_edge * self.crop_fraction))

    @property
    def image_size(self) -> tuple[int, int]:
        return smart_resize(self.image_edge, self.image_edge)

    def to_dict(self) -> dict:
        return asdict(self)


def processor_from_gr00t_json(doc: dict) -> ProcessorConfig:
    """Isaac-GR00T's processor_config.json -> ProcessorConfig (its image settings; the defaults where absent)."""
    kw = doc.get("processor_kwargs", doc)
    out = {}
    if kw.get("shortest_image_edge"):
        out["image_edge"] = int(kw["shortest_image_edge"])
    if kw.get("crop_fraction"):
        out["crop_fraction"] = float(kw["crop_fraction"])
    return ProcessorConfig(**out)


class Processor:
    def __init__(self, cfg: ProcessorConfig, *, max_state_dim: int, max_action_dim: int, embodiment_id: int):
        self.cfg = cfg
        self.max_state_dim, self.max_action_dim, self.embodiment_id = max_state_dim, max_action_dim, embodiment_id

    def images(self, frames: dict, crop_u: torch.Tensor | None = None, *, cameras: Sequence[str] | None = None,
               draws: ImageDraws | None = None) -> torch.Tensor:
        """{slot: (B, K, 3, h, w)} normalized, each camera its own size -> (B*K*V, 3, H, W), frame-major
        then camera in `cameras` order (the modality config's video keys; None: sorted slots).
        `draws` (images.image_draws, a row per sample): the training crop and colour jitter;
        else `crop_u` (B, 2) uniforms in [0, 1) (y, x) place the training crop, no jitter; neither:
        the centred crop of evaluation."""
        c = self.cfg
        geo = Geometry(edge=c.image_edge, crop=c.crop, size=c.image_size)
        units = (-c.image_mean / c.image_std, (1.0 - c.image_mean) / c.image_std)  # levels 0 and 255
        out = []
        for slot in sorted(frames) if cameras is None else cameras:
            x = frames[slot]
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

    def __call__(self, batch: dict, crop_u: torch.Tensor | None = None) -> dict:
        """A loader batch (or an observation batch without actions, Policy's) -> the model's inputs."""
        state = batch["state"]
        if state.shape[-1] > self.max_state_dim:
            raise ConfigError(f"the data has {state.shape[-1]}-D state; the model takes at most {self.max_state_dim}")
        out = {"pixel_values": self.images(batch["frames"], crop_u),
               "input_ids": batch["task_tokens"], "attention_mask": batch["task_mask"],
               "state": F.pad(state.float(), (0, self.max_state_dim - state.shape[-1])),
               "embodiment_id": torch.full((state.shape[0],), self.embodiment_id, dtype=torch.long,
                                           device=state.device)}
        if "action" in batch:
            action = batch["action"]
            da = action.shape[-1]
            if da > self.max_action_dim:
                raise ConfigError(f"the data has {da}-D action; the model takes at most {self.max_action_dim}")
            dims = torch.arange(self.max_action_dim, device=action.device) < da
            rows = batch["action_valid"] & batch["sample_valid"][:, None]
            out["action"] = F.pad(action.float(), (0, self.max_action_dim - da))
            out["action_mask"] = (rows[:, :, None] & dims[None, None]).float()
        return out

