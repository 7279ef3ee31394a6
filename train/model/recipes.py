"""Model recipes: plain functions returning a ModelConfig.

`tiny` runs a CPU step well under a second (tests), `small` is a real but
modest model, `1.6b` is the GPU target (~1.6B parameters; count it on the
meta device, never instantiate it on CPU). Data-dependent fields (frame size,
cameras, dims, horizon) come from the shard index through `resolve`.
"""

from __future__ import annotations

import dataclasses

from loongforge.shared.errors import ConfigError
from loongforge.shared.index import ShardIndex
from loongforge.train.config import ModelConfig


# NOTE: frames are resized on the device to 2 * sqrt(vision_tokens) * patch (tiny 64, small and
# 1.6b 224 as GR00T) and pixel-unshuffled to vision_tokens per frame, so the step cost does not
# depend on the dataset's resolution. Trunk blocks cost 12 d^2, head blocks 14 d^2 (+2 d^2 adaptive
# norm); depths are set so each recipe keeps its parameter count (train/README.md).


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{"dim": 48, "depth": 2, "head_depth": 2, "bin_depth": 2, "heads": 4, "patch": 8,
                          "vision_tokens": 16, "action_bins": 32, **kw})


def small(**kw) -> ModelConfig:
    return ModelConfig(**{"dim": 320, "depth": 4, "head_depth": 2, "bin_depth": 2, "heads": 5, "patch": 14,
                          "vision_tokens": 64, "action_bins": 128, **kw})


def large_1_6b(**kw) -> ModelConfig:
    return ModelConfig(**{"dim": 2048, "depth": 24, "head_depth": 5, "bin_depth": 2, "heads": 16, "patch": 14,
                          "vision_tokens": 64, "action_bins": 256, "image_size": (224, 224), **kw})


RECIPES = {"tiny": tiny, "small": small, "1.6b": large_1_6b}


def resolve(name: str, index: ShardIndex, *, max_text_tokens: int, max_frames: int, **overrides) -> ModelConfig:
    """The recipe's config with the data-dependent fields filled from the index."""
    try:
        make = RECIPES[name]
    except KeyError:
        raise ConfigError(f"recipe: unknown {name!r}; use one of {sorted(RECIPES)}") from None
    ds = index.dataset
    base = make()
    data = dict(image_size=(ds.height, ds.width), cameras=len(ds.cameras), max_frames=max_frames,
                state_dim=ds.state_dim, action_dim=ds.action_dim, action_horizon=ds.action_horizon,
                max_text_tokens=max_text_tokens)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return ModelConfig(**{**fields, **data, **overrides})

