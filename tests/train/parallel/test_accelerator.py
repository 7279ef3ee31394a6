"""The run's device and DeepSpeed's accelerator are one choice, on a machine with or without CUDA
(CUDA is mocked here: these check the choice, not a kernel), and every launch path leaves it to
the trainer instead of forcing DeepSpeed onto the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import real_accelerator

from loongforge.shared.errors import ConfigError
from loongforge.train.parallel import engine
from tests.train.train_launch import launch_env

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def ds_accelerator(monkeypatch):
    """Restore DeepSpeed's cached accelerator and the variable after each test."""
    monkeypatch.setattr(real_accelerator, "ds_accelerator", real_accelerator.get_accelerator())
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_without_cuda_auto_is_cpu_and_deepspeed_follows(ds_accelerator, monkeypatch):
    _gpus(monkeypatch, 0)
    device = engine.pick_device("auto")
    assert device == torch.device("cpu")
    assert engine.align_ds_accelerator(device) == "cpu"
    with pytest.raises(ConfigError, match="--device cpu"):
        engine.pick_device("cuda")


def test_with_cuda_a_forced_cpu_accelerator_is_overridden(ds_accelerator, monkeypatch, caplog):
    """What tests and benchmarks used to do (DS_ACCELERATOR=cpu) on a GPU machine: DeepSpeed
    would build its engine on CPU while the trainer sends batches to cuda."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    _gpus(monkeypatch, 1)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    real_accelerator.set_accelerator(CPU_Accelerator())
    device = engine.pick_device("auto")
    assert device == torch.device("cuda", 0)
    assert engine.align_ds_accelerator(device) == "cuda"
    assert real_accelerator.get_accelerator().device_name() == "cuda"
    assert engine.os.environ["DS_ACCELERATOR"] == "cuda"  # for the processes this rank starts
    assert "DS_ACCELERATOR=cpu overridden" in caplog.text


def test_explicit_cpu_on_a_cuda_machine_moves_deepspeed_to_cpu(ds_accelerator, monkeypatch):
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    _gpus(monkeypatch, 1)
    real_accelerator.set_accelerator(CUDA_Accelerator())  # DeepSpeed's own probe on a GPU machine
    assert engine.align_ds_accelerator(engine.pick_device("cpu")) == "cpu"


def test_two_ranks_on_one_gpu_are_refused(ds_accelerator, monkeypatch):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"local rank 1 needs cuda:1 but this machine has 1 CUDA device.*"
                                          r"--nproc_per_node 1.*--device cpu"):
        engine.pick_device("auto")
    _gpus(monkeypatch, 2)
    assert engine.pick_device("auto") == torch.device("cuda", 1)


def test_cpu_launches_hide_gpus_and_force_nothing(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    env = launch_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "DS_ACCELERATOR" not in env
    gpu = launch_env({"PATH": "", "CUDA_VISIBLE_DEVICES": ""}, cuda=True)
    assert "CUDA_VISIBLE_DEVICES" not in gpu and "DS_ACCELERATOR" not in gpu


def test_no_launch_path_forces_deepspeeds_accelerator():
    """Only the trainer (engine.align_ds_accelerator) sets DS_ACCELERATOR; the shell launchers
    may set it only where there is no GPU (`nvidia-smi` absent)."""
    setting = re.compile(r"""DS_ACCELERATOR=|["']DS_ACCELERATOR["']\s*(:|\]\s*=(?!=)|,)""")
    found = []
    for folder in ("train", "benchmarks", "tests", "loongforge"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "test_accelerator.py" or path == REPO / "train" / "parallel" / "engine.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if setting.search(line) and "monkeypatch" not in line and "pop(" not in line:
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    makefile = (REPO / "Makefile").read_text()
    found += [f"Makefile: {line}" for line in makefile.splitlines() if "DS_ACCELERATOR=" in line]
    assert not found, "\n".join(found)
