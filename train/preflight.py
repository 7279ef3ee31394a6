"""Checks that need no process group: run in each rank before init_distributed,
and by the launch scripts in the launcher process (`--check-config`).

A bad recipe, a batch that does not divide by ranks x accumulation, or a data
root without an index must fail in seconds with exit code 2, not after the
rendezvous and DeepSpeed's start (36-137 s on a loaded node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from loongforge.shared.errors import CheckpointError, ConfigError, FormatError, LoongForgeError
from loongforge.train.ckpt.gr00t import check_gr00t_weights
from loongforge.train.config import TrainConfig
from loongforge.train.data.training_data import TrainingData, load_training_data
from loongforge.train.kernels import graphs
from loongforge.train.observe.tracking import resolve_report_to
from loongforge.train.parallel.engine import ds_config, pick_device
from loongforge.train.parallel.plan import check_layout, plan_of
from loongforge.train.recipes import RECIPES, ModelPlan, base_configs, plan_model


@dataclass(frozen=True)
class Checked:
    index: TrainingData
    model: ModelPlan  # architecture, image processing, prompts, embodiment (train/recipes.py)
    world: int
    ds_config: dict

    @property
    def model_cfg(self):
        return self.model.model


def launch_world() -> int:
    """The rank count the launcher announced (torchrun and deepspeed both set WORLD_SIZE); 1 alone."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world}: must be >= 1")
    return world


def preflight(cfg: TrainConfig, world: int | None = None) -> Checked:
    """Everything about the config that can be wrong, checked without a process group."""
    world = launch_world() if world is None else world
    resolve_report_to(cfg.track.report_to)  # --report-to wandb without the package: one line, exit 2
    if cfg.recipe not in RECIPES:
        raise ConfigError(f"recipe: unknown {cfg.recipe!r}; use one of {', '.join(RECIPES)}")
    dp = plan_of(cfg).dp(world)  # world % (tp*sp), before any group exists
    # Divisibility only depends on the world and the config; the device does not matter here.
    conf = ds_config(cfg, world=dp, device=torch.device("cpu"))
    try:
        index = load_training_data(cfg.data)  # a format-1 root is refused here with the convert hint
    except FormatError as exc:
        raise ConfigError(f"data.root: {exc}") from None
    except (LoongForgeError, OSError) as exc:
        raise ConfigError(f"data.root: cannot read the shard index under {cfg.data.root!r} "
                          f"({type(exc).__name__}: {exc}); check --data") from None
    if cfg.model.init_from is not None:  # its weights' names and shapes, from the headers: before anything is
        try:  # written, and before the data is matched to it (the --tune-* flags change no shape)
            check_gr00t_weights(base_configs(cfg)[0], cfg.model.init_from)
        except CheckpointError as exc:
            raise ConfigError(f"--init-from {exc}") from None
    model = plan_model(cfg, index)  # recipe or --init-from checkpoint, the data, the tokenizer
    check_layout(cfg, world, model.model)  # heads and MLP widths split by tp x sp
    if cfg.memory.cuda_graphs:
        graphs.check(device=pick_device(cfg.run.device), zero_stage=cfg.parallel.zero_stage,
                     ac_every=cfg.memory.ac_every, tp=cfg.parallel.tp)
    return Checked(index=index, model=model, world=world, ds_config=conf)
