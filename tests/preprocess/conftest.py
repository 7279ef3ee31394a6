"""Preprocess fixtures: small real LeRobot v2 datasets (H.264 via PyAV), made
once per session, and a helper that runs the real Beam job in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from loongforge.preprocess.config import PreprocessConfig

IN_MEMORY = ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
SMALL = {"episodes": 3, "frames": (14, 22), "height": 64, "width": 64, "gop": 6}


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> str:
    from loongforge.preprocess.samples.dataset import generate_dataset

    return str(generate_dataset(tmp_path_factory.mktemp("lerobot") / "sample", **SMALL))


@pytest.fixture(scope="session")
def quirky_dataset(tmp_path_factory) -> str:
    from loongforge.preprocess.samples.dataset import QUIRKS, generate_dataset

    return str(generate_dataset(tmp_path_factory.mktemp("lerobot") / "quirky", **{**SMALL, "episodes": 4},
                                quirks=QUIRKS))


def _run_in_memory(input_root: str, output: str, **overrides) -> dict:
    from loongforge.preprocess.pipeline import run_job

    cfg = PreprocessConfig(input=input_root, output=output, workers=1, **overrides)
    return run_job(cfg, IN_MEMORY)


@pytest.fixture(scope="session")
def run_in_memory():
    """The real job on Beam's in-process FnApiRunner (fast to start, one worker):
    run_in_memory(input, output, **PreprocessConfig overrides) -> summary."""
    return _run_in_memory


def tree(root: str) -> dict[str, bytes]:
    """Every file under a shard root, by relative path: two runs' outputs compare byte for byte."""
    base = Path(root)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}
