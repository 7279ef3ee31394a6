"""--cuda-graphs (train/kernels/graphs.py): refused where it cannot work, before any process group; the
policy wiring and the gradient ownership checked on CPU with a stand-in backend; the real CUDA
graph trees in `make gpu-check`."""

import argparse
import copy
import os
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.n16 import build, make_inputs  # noqa: E402
from tests.train.kernels.test_fusion import BLOCKS  # noqa: E402

from loongforge.shared.errors import ConfigError  # noqa: E402
from loongforge.train.parallel import engine
from loongforge.train.kernels import graphs
from loongforge.train import flags, launch as entry  # noqa: E402
from loongforge.train.config import DataConfig, MemoryConfig, ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from loongforge.train.parallel.parallelize import apply_memory_policies  # noqa: E402

GPU = torch.device("cuda", 0)  # a device object only: check() must not touch CUDA


def test_refused_on_cpu_before_any_process_group(train_root, tmp_path, monkeypatch, capsys):
    root, _ = train_root
    reached = []
    monkeypatch.setattr(engine, "init_distributed", lambda *a, **k: reached.append(a))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    p = argparse.ArgumentParser()
    flags.add_train_args(p)
    args = p.parse_args(["--data", root, "--run-dir", str(tmp_path), "--device", "cpu", "--cuda-graphs"])
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert entry.run_args(args) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert reached == []
    assert "config error: memory.cuda_graphs" in err and "needs a CUDA device" in err and "--device cuda" in err


@pytest.mark.parametrize("kw, says", [
    (dict(device=torch.device("cpu"), zero_stage=2, ac_every=0, tp=1), "needs a CUDA device"),
    (dict(device=GPU, zero_stage=3, ac_every=0, tp=1), "ZeRO-3"),
    (dict(device=GPU, zero_stage=2, ac_every=2, tp=1), "--ac-every"),
    (dict(device=GPU, zero_stage=1, ac_every=0, tp=2), "--tp"),
])
def test_check_refuses_what_does_not_compose(kw, says):
    with pytest.raises(ConfigError, match=says):
        graphs.check(**kw)


def test_check_accepts_zero_0_to_2_on_cuda_and_the_config_refuses_ac():
    for stage in (0, 1, 2):
        graphs.check(device=GPU, zero_stage=stage, ac_every=0, tp=1)
    with pytest.raises(ConfigError, match="memory.cuda_graphs"):
        MemoryConfig(cuda_graphs=True, ac_every=4)
    assert graphs.compile_options("auto") == {"backend": "inductor", "mode": "reduce-overhead"}
    assert graphs.compile_options("off") == {"backend": "cudagraphs", "mode": None}


def test_policies_compile_blocks_mark_steps_and_own_accumulated_grads(monkeypatch):
    # CPU stand-in for the CUDA path: the same wiring (check, compile options, gradient hooks,
    # the step mark), with aot_eager in place of reduce-overhead, which needs CUDA.
    torch._dynamo.reset()
    checked, marks = [], []
    monkeypatch.setattr(graphs, "check", lambda **kw: checked.append(kw))
    monkeypatch.setattr(graphs, "compile_options", lambda fuse: {"backend": "aot_eager", "mode": None})
    monkeypatch.setattr(graphs, "mark_step_begin", lambda: marks.append(1))
    cfg = TrainConfig(data=DataConfig(root="unused"), run=RunConfig(run_dir="unused"),
                      parallel=ParallelConfig(zero_stage=1), memory=MemoryConfig(cuda_graphs=True, fuse="off"))
    ref, args = build(), make_inputs(0)
    m = copy.deepcopy(ref)
    pol = apply_memory_policies(m, cfg, torch.device("cpu"))
    assert checked == [dict(device=torch.device("cpu"), zero_stage=1, ac_every=0, tp=1)]
    assert pol.fused == BLOCKS and pol.graphed
    for model in (ref, m):  # two accumulated micro-steps, as --grad-accum 2 under ZeRO 0/1
        model.zero_grad(set_to_none=True)
        for _ in range(2):
            if model is m:
                pol.before_forward()
            model(*args)["loss"].backward()
    assert marks == [1, 1]
    want = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if want[name].grad is not None:
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    # The hook is on every block parameter and hands AccumulateGrad a copy of its input.
    g = torch.ones(3)
    assert graphs._own(g) is not g and torch.equal(graphs._own(g), g)
    assert graphs.own_grads(copy.deepcopy(ref)) == sum(
        1 for n, _ in ref.named_parameters() if any(n.startswith(b + ".") for b in BLOCKS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphed_blocks_match_eager_with_accumulation_and_record_graphs(train_root):
    from torch._dynamo.utils import counters

    from tests.train.gpu_model import model_and_inputs

    torch._dynamo.reset()
    counters.clear()
    cfg = TrainConfig(data=DataConfig(root="unused"), run=RunConfig(run_dir="unused"),
                      parallel=ParallelConfig(zero_stage=1), memory=MemoryConfig(cuda_graphs=True))
    ref, args = model_and_inputs(train_root[0], "tiny", device="cuda", batch_size=4)
    m = copy.deepcopy(ref)
    pol = apply_memory_policies(m, cfg, GPU)
    for step in range(4):  # recording (first steps), then replays; 2 micro-steps each
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            for _ in range(2):
                if model is m:
                    pol.before_forward()
                loss = model(*args)["loss"]
                loss.backward()
        want = dict(ref.named_parameters())
        for name, p in m.named_parameters():
            if want[name].grad is not None:
                torch.testing.assert_close(p.grad, want[name].grad, rtol=2e-3, atol=2e-5, msg=f"step {step}: {name}")
    # compiled regions inductor refused to graph (a CPU tensor, a mutated input) still run, without graphs
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor refused to graph a block (see the log)"
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(0, create_if_none_exists=False)
    assert manager is not None and sum(len(r) for r in manager.roots.values()) >= 1, "no CUDA graph recorded"


def test_gpu_check_compares_gpu_idle_before_and_after_graphs():
    from loongforge.benchmarks.micro import gpu_check

    def run(steps, idle, launch):
        return {"breakdown": {"traces": [{"kind": "gpu", "step_s": steps, "gpu_idle_s": idle,
                                          "launch_overhead_s": launch}]}}

    lo = gpu_check.launch_overhead(run([0.010, 0.012], [0.004, 0.004], [0.003, 0.003]),
                                   run([0.008, 0.008], [0.0015, 0.0015], [0.001, 0.001]))
    assert lo["ok"] and lo["launch_overhead_s_ratio"] == pytest.approx(1 / 3)
    assert lo["launch_overhead_share"]["eager"] == pytest.approx(0.003 / 0.011)
    assert lo["cuda_graphs"]["gpu_idle_s"] == pytest.approx(0.0015)
    assert not gpu_check.launch_overhead(run([0.01], [0.0], [0.0]), {"breakdown": None})["ok"]  # a failed run
