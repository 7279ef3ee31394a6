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


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{"dim": 64, "depth": 2, "heads": 4, "patch": 8, "action_bins": 32, **kw})


def small(**kw) -> ModelConfig:
    return ModelConfig(**{"dim": 384, "depth": 6, "heads": 6, "patch": 16, "action_bins": 128, **kw})


def large_1_6b(**kw) -> ModelConfig:
    # 32 blocks x 12*d^2 at d=2048 ~ 1.61B: the backbone dominates, embeddings are small.
    return ModelConfig(**{"dim": 2048, "depth": 32, "heads": 16, "patch": 14, "action_bins": 256,
                          "image_size": (224, 224), **kw})


RECIPES = {"tiny": tiny, "small": small, "1.6b": large_1_6b}


def _patch_for(preferred: int, h: int, w: int) -> int:
    for p in range(min(preferred, h, w), 0, -1):
        if h % p == 0 and w % p == 0:
            return p
    return 1


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
                max_text_tokens=max_text_tokens, patch=_patch_for(base.patch, ds.height, ds.width))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return ModelConfig(**{**fields, **data, **overrides})


def count_params_meta(cfg: ModelConfig) -> int:
    """Parameter count without allocating weights (meta device)."""
    import torch

    from loongforge.train.model import VLAModel, count_parameters

    with torch.device("meta"):
        return count_parameters(VLAModel(cfg))
