"""One rank of test_zero3_ranks_hold_a_partition: builds the small model as the trainer does
(parallelize, ZeRO-3: constructed under deepspeed.zero.Init) and writes its parameter counts to ARGV[2]."""

import json
import os
import sys

import torch

from loongforge.train.data.training_data import load_training_data
from loongforge.train.config import DataConfig, ParallelConfig, RunConfig, TrainConfig
from loongforge.train.model.build import build_model
from loongforge.train.parallel import engine, plan
from loongforge.train.parallel.parallelize import parallelize
from loongforge.train.recipes import plan_model


def main(root: str, out_dir: str) -> None:
    rank, world = engine.init_distributed(torch.device("cpu"), 120.0)
    cfg = TrainConfig(data=DataConfig(root=root, global_batch_size=8), run=RunConfig(run_dir=out_dir),
                      parallel=ParallelConfig(zero_stage=3, precision="fp32"), recipe="small")
    model_cfg = plan_model(cfg, load_training_data(cfg.data)).model
    built = parallelize(lambda: build_model(model_cfg), cfg, plan.initialize(plan.plan_of(cfg), verbose=False),
                        device=torch.device("cpu"))
    model = built.engine.module
    full, local = engine.param_counts(model)
    materialised = sum(p.numel() for p in model.parameters())  # ZeRO-3 leaves empty placeholders
    with torch.device("meta"):
        reference = sum(p.numel() for p in build_model(model_cfg).parameters())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"full": full, "local": local, "materialised": materialised, "reference": reference,
                   "world": world}, f)
    engine.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
