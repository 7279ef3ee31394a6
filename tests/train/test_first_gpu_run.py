"""First-GPU-run defects found by reading the CUDA path: each has a CPU
test where one is possible; what only a GPU can show is marked `gpu`."""

import json
import os
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import VENV_BIN, _port, launch  # noqa: E402

from loongforge.train.parallel import engine  # noqa: E402
from loongforge.train.config import DataConfig, ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from loongforge.train.data.loader import BlockLoader  # noqa: E402


def test_bare_cuda_resolves_to_the_current_device(monkeypatch):
    """torch.cuda.set_device(torch.device("cuda")) raises "Expected a torch.device with a specified index"."""
    from loongforge.train.data.prefetch import resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert resolve_device("cpu") == torch.device("cpu")


def _cfg(zero: int = 2) -> TrainConfig:
    return TrainConfig(data=DataConfig(root="/x", global_batch_size=8), run=RunConfig(run_dir="/r"),
                       parallel=ParallelConfig(zero_stage=zero))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_cuda_config_never_needs_an_op_build(zero, monkeypatch):
    """DeepSpeed's plain "AdamW" on CUDA is FusedAdam, JIT-built with nvcc/ninja: never ask for it
    unless the installed DeepSpeed has it prebuilt."""
    monkeypatch.setattr(engine, "fused_adam_prebuilt", lambda: False)
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        conf = engine.ds_config(_cfg(zero), world=2, device=device)
        opt = conf["optimizer"]
        assert opt["type"] == "AdamW" and opt["params"]["torch_adam"] is True, device
        assert "offload_optimizer" not in conf["zero_optimization"]  # DeepSpeedCPUAdam is a build too
    assert engine.ds_config(_cfg(zero), world=2, device=torch.device("cuda", 0))["optimizer"]["params"]["fused"]
    monkeypatch.setattr(engine, "fused_adam_prebuilt", lambda: True)
    assert "torch_adam" not in engine.ds_config(_cfg(zero), world=2, device=torch.device("cuda", 0))["optimizer"][
        "params"]


def test_torch_adam_params_are_what_torch_accepts():
    """The params DeepSpeed forwards to torch.optim.AdamW (minus torch_adam) construct it."""
    conf = engine.ds_config(_cfg(), world=1, device=torch.device("cpu"))
    params = {k: v for k, v in conf["optimizer"]["params"].items() if k != "torch_adam"}
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **params, foreach=None)


@pytest.mark.slow
def test_zero3_ranks_hold_a_partition(train_root, tmp_path):
    """ZeRO-3 builds the model under zero.Init: each of 2 gloo ranks holds about half the elements."""
    root, _ = train_root
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero3_probe.py")
    proc = launch([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_port()), probe,
                   root, str(tmp_path)], cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    full = ranks[0]["reference"]
    assert full > 1_000_000
    for r in ranks:
        assert r["full"] == full and r["world"] == 2
        assert r["materialised"] == 0  # parameters are empty placeholders, not full tensors
        assert r["local"] <= full // 2 + 2 * len(ranks) * 1024, r  # its partition (plus padding), never all
    assert sum(r["local"] for r in ranks) >= full


@pytest.mark.slow
def test_close_mid_epoch_is_bounded_with_stuck_workers(train_root):
    """close() must not wait for a prefetch thread blocked in pool.get (up to worker_timeout_s):
    signal, unblock, join. The 2 workers are stopped (SIGSTOP: a worker stuck in a slow read)."""
    root, index = train_root
    loader = BlockLoader(root, dataset=index.ds, batch_size=4, num_workers=2, block_window=8)
    pids = []
    try:
        it = iter(loader)
        for _ in range(3):
            next(it)
        loader.load_state_dict(loader.state_dict())  # restart the pipeline mid-epoch (step 3)
        it = iter(loader)
        pids = [p.pid for p in loader._pool._procs]
        for pid in pids:  # before they can decode anything: the prefetch thread now waits in pool.get
            os.kill(pid, signal.SIGSTOP)
        assert len(pids) == 2 and loader.consumed == 12
        time.sleep(0.5)
        t0 = time.monotonic()
        loader.close()
        took = time.monotonic() - t0
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        loader.close()
    assert took < 2.0, took
    assert all(not os.path.exists(f"/proc/{pid}/status") or "zombie" in open(f"/proc/{pid}/status").read()
               for pid in pids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bare_cuda_loader_delivers_on_the_current_device(train_root):
    root, index = train_root
    with BlockLoader(root, dataset=index.ds, batch_size=4, max_steps=2, device="cuda", num_workers=1) as loader:
        batches = list(loader)
    assert len(batches) == 2
    assert batches[0]["action"].device == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_refuses_a_cpu_torch_clearly(tmp_path, capsys):
    from loongforge.benchmarks.cli import main as bench

    assert bench(["gpu-check", "--out", str(tmp_path)]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [pytest.param((), marks=pytest.mark.full, id="plain"),  # topk covers the plumbing
                                   pytest.param(("--zero", "3", "--grad-compression", "topk"), id="topk")])
def test_gpu_check_run_plumbing_on_cpu(train_root, tmp_path, extra):
    """The gpu-check script's run + profile + checks, driven on CPU: it must complete and flag
    exactly what only a GPU provides (so its first GPU run does not die on its own plumbing).
    The topk run (1 rank) must also pass the check that the compressor synced every step."""
    from loongforge.benchmarks.micro import gpu_check

    assert extra in ((), gpu_check.TOPK)
    root, _ = train_root
    res = gpu_check.train_run("tiny", root, str(tmp_path), 6, 240, device="cpu", extra=extra)
    assert res["exit_code"] == 0, res.get("log_tail")
    assert res["optimizer"]["params"]["torch_adam"] is True and res["timers"] == ["host"]
    assert res["breakdown"]["traces"] and "step-time breakdown" in res["table"]
    assert not res["ok"] and len(res["problems"]) == 2  # no CUDA-event timing, no GPU trace


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_times_with_events_and_profiles_from_kernels(train_root, tmp_path):
    """One rank on CUDA: torch AdamW (no op build), CUDA-event timers (synced only in the trace
    window), and a profile whose table comes from the kernel timeline."""
    root, _ = train_root
    run_dir = tmp_path / "run"
    proc = launch([sys.executable, "-m", "loongforge.train", "--data", root, "--run-dir", str(run_dir), "--steps", "8",
                   "--device", "cuda", "--profile-steps", "3:6", "--workers", "2", "--batch-size", "8",
                   "--zero", "3"], cwd=str(tmp_path), timeout=300, cuda=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    conf = json.loads((run_dir / "ds_config.json").read_text())
    assert conf["optimizer"]["params"].get("torch_adam") or engine.fused_adam_prebuilt()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["timer"] for r in rows] == ["cuda_events"] * 3 + ["cuda_events_synced"] * 3 + ["cuda_events"] * 2
    assert all(0 < r["forward_s"] <= r["step_s"] for r in rows)
    prof = launch([sys.executable, "-m", "loongforge", "profile", str(run_dir), "--json", "--no-chart"],
                  cwd=str(tmp_path), timeout=120)
    b = json.loads(prof.stdout)
    assert b["traces"][0]["kind"] == "gpu" and len(b["traces"][0]["launch_overhead_s"]) == 3
    assert sum(b["percent"].values()) == pytest.approx(100.0, abs=0.5)


@pytest.mark.slow
def test_the_step_reads_nothing_back_from_the_device(train_root, tmp_path):
    """No host read of a tensor (.item(), .cpu(), .tolist(), bool(), float(), ...) in the project's code
    while a step runs: on CUDA each waits for the GPU, so the host cannot queue the next step while this
    one computes (the step timer's own promise). The NaN guard's flag stays on the device (DeepSpeed's
    gradient check skips the step), the losses are read with the log record one step late. A real run
    with ZeRO-2 (DeepSpeed's ZeRO optimizer checks the gradients), NaN injected at step 2."""
    root, _ = train_root
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_sync_probe.py")
    report, run_dir = tmp_path / "reads.json", tmp_path / "run"
    env = dict(os.environ, LOONGFORGE_INJECT_NAN="2")
    proc = launch([sys.executable, probe, str(report), "--data", root, "--run-dir", str(run_dir), "--steps", "4",
                   "--batch-size", "8", "--recipe", "tiny", "--zero", "2", "--workers", "0",
                   "--no-ds-breakdown", "--device", "cpu"], cwd=str(tmp_path), env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reads = json.loads(report.read_text())
    assert reads["in_step"] == [], "host reads inside the step:\n" + "\n".join(sorted(set(reads["in_step"])))
    assert reads["in_log"] > 0  # the losses are read, with the log record
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert [r["nonfinite_skip"] for r in rows] == [None, None, "loss", None]
