"""Worker of test_ac.py's and test_precision.py's ZeRO-3 tests (run by torchrun, 2 ranks, once for both:
`ac_zero3_worker.py ROOT RUN_DIR ac fp8`): gradients with and without activation checkpointing, and FP8
linears with AC, built exactly as the trainer builds (parallelize: the policies, then the engine)."""

import os
import sys

import torch


def build(root, run_dir, memory, depth=3):
    from loongforge.train.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
    from loongforge.train.data.training_data import load_training_data
    from loongforge.train.model.build import build_model
    from loongforge.train.model.noise import noise_for
    from loongforge.train.parallel import plan
    from loongforge.train.parallel.parallelize import parallelize
    from loongforge.train.recipes import plan_model
    from loongforge.train.tune.ac import _one_batch

    rank = torch.distributed.get_rank()
    cfg = TrainConfig(data=DataConfig(root=root, global_batch_size=4, video_deltas=(-1, 0)),
                      run=RunConfig(run_dir=run_dir), memory=memory, recipe="tiny",
                      model=ModelConfig(dit_dropout=0.0), parallel=ParallelConfig(zero_stage=3, wall_clock_breakdown=False))
    index = load_training_data(cfg.data)  # 2 frames per camera and sample
    mplan = plan_model(cfg, index)
    mcfg = mplan.model.replace(dit={"num_layers": depth})
    torch.manual_seed(0)
    names = []

    def build_and_name():  # as Trainer: built under zero.Init for ZeRO-3, then the policies, then the engine
        model = build_model(mcfg)
        names.extend(n for n, _ in model.named_parameters())
        return model

    state = plan.initialize(plan.plan_of(cfg), verbose=False)
    built = parallelize(build_and_name, cfg, state, device=torch.device("cpu"))
    e, policies = built.engine, built.policies
    batch = _one_batch(root, index, torch.device("cpu"), mplan)
    batch = {k: ({s: v[rank::2] for s, v in b.items()} if isinstance(b, dict) else b[rank::2])
             for k, b in batch.items()}  # each rank its own samples
    n = batch["action"].shape[0]
    noise, u, crop = noise_for(0, 0, range(rank, 2 * n, 2), (n, mcfg.action_horizon, mcfg.max_action_dim),
                               torch.device("cpu"))
    r = index.roots[0]
    return e, policies, names, (mplan.processor(batch, r.tag, r.cameras, crop), noise, u)


DIT = "action_head.model.transformer_blocks."


def fp8_losses(root, run_dir, fp8):
    from loongforge.train.config import MemoryConfig

    mem = MemoryConfig(ac_every=1, fp8=fp8, fp8_warmup_steps=2, fp8_min_features=16)
    e, policies, _, args = build(root, run_dir, mem, depth=4)
    # DiT blocks 1, 2: to_q, to_k, to_v, to_out.0, ff.net.0.proj, ff.net.2 each (the 2-layer vision tower and
    # LLM have no inner block)
    assert len(policies.fp8_linears) == (12 if fp8 else 0), policies.fp8_linears
    losses = []
    for step in range(4):
        policies.on_step(step)
        loss = e(*args)["loss"]
        e.backward(loss)
        e.step()
        losses.append(loss.item())
    e.destroy()
    return losses


def main_fp8(root, run_dir):
    ref, got = fp8_losses(root, run_dir, False), fp8_losses(root, run_dir, True)
    assert all(v == v and abs(v) < 1e6 for v in got), got
    assert got[0] == ref[0], (got, ref)  # warm-up step 0 runs the high-precision path
    assert got[3] != ref[3], (got, ref)  # after the warm-up the GEMMs are FP8
    print("FP8-ZERO3-OK", got, ref, flush=True)


def grads(root, run_dir, every):
    import deepspeed

    from loongforge.train.config import MemoryConfig

    e, policies, names, args = build(root, run_dir, MemoryConfig(ac_every=every))
    assert (DIT + "0" in policies.checkpointed) == (every > 0) and (DIT + "1" in policies.checkpointed) == (every == 1)
    e.backward(e(*args)["loss"])
    full = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in zip(names, e.module.parameters())}
    e.destroy()
    return {n: g.clone() for n, g in full.items() if g is not None}


class ScaleBlock(torch.nn.Module):
    """A block with a direct parameter (as adaLN / layer-scale blocks have): ZeRO-3 gathers it by
    the block's own hooks, which run outside the checkpointed region."""

    def __init__(self, d):
        super().__init__()
        self.gamma = torch.nn.Parameter(torch.full((d,), 0.5))
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Toy(torch.nn.Module):
    def __init__(self, d=16, depth=3):
        super().__init__()
        self.layers = torch.nn.ModuleList([ScaleBlock(d) for _ in range(depth)])

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)
        return x.square().mean()


def toy_grads(every):
    import deepspeed

    from loongforge.train.kernels.checkpointing import apply_ac

    torch.manual_seed(0)
    model = Toy()
    names = [n for n, _ in model.named_parameters()]
    apply_ac(model, every)
    conf = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    e, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=conf)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    e.backward(e(x))
    out = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in zip(names, e.module.parameters())}
    e.destroy()
    return out


def main():
    from loongforge.train.parallel import engine as eng

    root, run_dir = sys.argv[1], sys.argv[2]
    eng.init_distributed(torch.device("cpu"))
    modes = sys.argv[3:] or ["ac"]  # "ac fp8": both checks in one launch (tests/train/conftest.py)
    if "ac" in modes:
        ref = grads(root, run_dir, 0)
        for every in (1, 2):
            got = grads(root, run_dir, every)
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=f"every={every} {n}")
        ref = toy_grads(0)
        got = toy_grads(1)
        assert ref["layers.0.gamma"].abs().sum() > 0
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=f"toy {n}")
        print("AC-ZERO3-OK", flush=True)
    if "fp8" in modes:
        main_fp8(root, run_dir)
    eng.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
