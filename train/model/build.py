"""The one place the model is built. Its config comes from train/recipes.py (recipe or checkpoint,
and the data) or from a checkpoint's sidecar; parallelism, precision and memory policies are applied
to the built module from outside (train/parallel/parallelize.py). ZeRO-3 calls `build_model` under
its partitioning context, which is why callers hand it over as a factory there."""

from __future__ import annotations

from loongforge.train.model.config import GrootConfig
from loongforge.train.model.model import Gr00tN1d6


def build_model(cfg: GrootConfig, attention: str = "auto") -> Gr00tN1d6:
    return Gr00tN1d6(cfg, attention=attention)
