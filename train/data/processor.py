"""A loader batch -> N1.6's model inputs, on the training device: what Isaac-GR00T's
Gr00tN1d6Processor + collator do on the CPU per sample, done here once per batch on tensors.

Images (every camera and frame of a sample is one image, frame-major then camera, as the reference
stacks them), each as N1.6 transforms it (LetterBoxPad, SmallestMaxSize(edge), FractionalRandomCrop
(fraction) in training / FractionalCenterCrop at evaluation, SmallestMaxSize(edge), then Eagle's
smart_resize to a multiple of 28 pixels):

    letterbox to a square (black)  ->  resize to edge x edge  ->  crop int(edge * fraction), at an
    offset drawn per sample (all its images share it) or centred  ->  resize to edge  ->  resize to
    the nearest multiple of 28

Interpolation: antialiased bilinear for the area resizes (the reference: OpenCV INTER_AREA) and
antialiased bicubic for the last one (the reference: PIL's bicubic); the geometry is exact, the
kernels are the GPU's. Pixel values are normalized (x - 0.5) / 0.5 (Eagle's processor); the loader
delivers them normalized with the same mean and std, and every step here is linear or a copy.

State (B, K, Ds) and action (B, H, Da), already normalized by the filler (min/max to [-1, 1], as
N1.6), are zero-padded to max_state_dim / max_action_dim; the action mask is 1 on real rows of good
samples and real dimensions. The prompt ids come from the loader (prompt.py's table).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from loongforge.shared.errors import ConfigError

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

    def images(self, frames: dict, crop_u: torch.Tensor | None) -> torch.Tensor:
        """{slot: (B, K, 3, h, w)} normalized -> (B*K*V, 3, H, W). crop_u (B, 2) uniforms in [0, 1)
        place the training crop; None = centred (evaluation)."""
        slots = sorted(frames)
        x = torch.stack([frames[s] for s in slots], dim=2)  # (B, K, V, 3, h, w): frame-major, then camera
        b, k, v = x.shape[:3]
        x = x.flatten(0, 2)
        c, e = self.cfg, self.cfg.image_edge
        h, w = x.shape[-2:]
        if h != w:  # LetterBoxPad: black bars centre the image in a square
            side, black = max(h, w), (0.0 - c.image_mean) / c.image_std
            top, left = (side - h) // 2, (side - w) // 2
            x = F.pad(x, (left, side - w - left, top, side - h - top), value=black)
        x = _resize(x, e, "bilinear")
        n = c.crop
        if n < e:
            if crop_u is None:
                oy = ox = torch.full((b,), (e - n) // 2, device=x.device, dtype=torch.long)
            else:
                offs = (crop_u.to(x.device).float() * (e - n + 1)).long().clamp_(0, e - n)
                oy, ox = offs[:, 0], offs[:, 1]
            x = _crop(x, oy.repeat_interleave(k * v), ox.repeat_interleave(k * v), n)
            x = _resize(x, e, "bilinear")
        hh, ww = c.image_size
        if (hh, ww) != (e, e):
            x = F.interpolate(x, size=(hh, ww), mode="bicubic", antialias=True, align_corners=False)
        return x

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


def _resize(x: torch.Tensor, edge: int, mode: str) -> torch.Tensor:
    """SmallestMaxSize(edge) of square images."""
    if x.shape[-1] == edge:
        return x
    return F.interpolate(x, size=(edge, edge), mode=mode, antialias=True, align_corners=False)


def _crop(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, n: int) -> torch.Tensor:
    """(N, C, E, E) -> (N, C, n, n), image i cut at (oy[i], ox[i]): one gather for the batch."""
    ar = torch.arange(n, device=x.device)
    rows, cols = (oy[:, None] + ar)[:, :, None], (ox[:, None] + ar)[:, None, :]
    idx = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[idx, :, rows, cols].permute(0, 3, 1, 2)
