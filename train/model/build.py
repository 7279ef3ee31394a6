"""The one place the model is built: its config (from a recipe and the data, or from a checkpoint's
sidecar) and the module. Parallelism, precision and memory policies are applied to the built
module from outside (train/parallel/parallelize.py); ZeRO-3 calls `build_model` under its
partitioning context, which is why callers hand it over as a factory there."""

from __future__ import annotations

import dataclasses

from loongforge.shared.errors import CheckpointError
from loongforge.train.config import ModelConfig, TrainConfig
from loongforge.train.model import recipes
from loongforge.train.model.model import VLAModel

# Filled from the data by recipes.resolve; a value set on cfg.model never overrides them.
DATA_FIELDS = ("image_size", "cameras", "max_frames", "state_dim", "action_dim", "action_horizon", "max_text_tokens")


def build_model(cfg: ModelConfig) -> VLAModel:
    return VLAModel(cfg)


def model_config(cfg: TrainConfig, index) -> ModelConfig:
    """The recipe's config, its data fields from the index (a data.training_data.TrainingData: frames
    per sample = len(video deltas)), and the fields the user set on cfg.model."""
    return recipes.resolve(cfg.recipe, index, max_text_tokens=cfg.data.max_text_tokens, max_frames=index.max_frames,
                           **model_overrides(cfg))


def model_overrides(cfg: TrainConfig) -> dict:
    """Fields the user set on cfg.model that differ from the default ModelConfig win over the recipe."""
    base = ModelConfig()
    return {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)
            if f.name not in DATA_FIELDS and getattr(cfg.model, f.name) != getattr(base, f.name)}


def model_config_from(doc: dict) -> ModelConfig:
    """The ModelConfig a checkpoint was trained with, from its sidecar (ckpt/checkpoint.py)."""
    raw = doc.get("model")
    if not isinstance(raw, dict):
        raise CheckpointError("checkpoint sidecar has no 'model' config (written by an older trainer); "
                              "retrain, or rebuild the ModelConfig by hand and use Policy(...)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known}
    return ModelConfig(**fields)
