"""Worker of test_ac.py's ZeRO-3 test (run by torchrun, 2 ranks): gradients with and without
activation checkpointing, built exactly as the trainer builds (policies, then the engine)."""

import os
import sys

import torch


def grads(root, run_dir, every):
    import deepspeed

    from loongforge.shared.index import load_index
    from loongforge.train import engine as eng, recipes
    from loongforge.train.config import DataConfig, MemoryConfig, ParallelConfig, RunConfig, TrainConfig
    from loongforge.train.model import VLAModel
    from loongforge.train.policies import apply_memory_policies
    from loongforge.train.trainer import noise_for
    from loongforge.train.tune import _one_batch

    rank = torch.distributed.get_rank()
    cfg = TrainConfig(data=DataConfig(root=root, global_batch_size=4), run=RunConfig(run_dir=run_dir),
                      parallel=ParallelConfig(zero_stage=3, wall_clock_breakdown=False),
                      memory=MemoryConfig(ac_every=every), recipe="tiny")
    index = load_index(root)
    mcfg = recipes.resolve("tiny", index, max_text_tokens=32, max_frames=2, depth=3)
    torch.manual_seed(0)
    model = VLAModel(mcfg)
    names = [n for n, _ in model.named_parameters()]
    policies = apply_memory_policies(model, cfg, torch.device("cpu"))
    assert len(policies.checkpointed) == (0 if every == 0 else len(range(0, 3, every)))
    e, _ = eng.build_engine(model, cfg, world=2, device=torch.device("cpu"))
    batch = _one_batch(root, index, torch.device("cpu"))
    batch = {k: ({s: v[rank::2] for s, v in b.items()} if isinstance(b, dict) else b[rank::2])
             for k, b in batch.items()}  # each rank its own samples
    noise, t = noise_for(0, 0, 0, rank, batch["action"].shape, "cpu")
    e.backward(e(batch, noise, t)["loss"])
    out = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in zip(names, e.module.parameters())}
    e.destroy()
    return out


def main():
    from loongforge.train import engine as eng

    root, run_dir = sys.argv[1], sys.argv[2]
    eng.init_distributed(torch.device("cpu"))
    ref = grads(root, run_dir, 0)
    for every in (1, 2):
        got = grads(root, run_dir, every)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=f"every={every} {n}")
    print("AC-ZERO3-OK", flush=True)
    eng.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
