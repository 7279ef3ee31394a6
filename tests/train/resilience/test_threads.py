"""The same layout trains the same weights whatever launched it (train/resilience/threads.py): 2 nodes x
1 rank (two torchrun processes, --nnodes 2) against 1 node x 2 ranks, with OMP_NUM_THREADS unset.
torchrun sets OMP_NUM_THREADS=1 only for --nproc-per-node > 1, so before each rank pinned its threads
itself the 2 x 1 ranks ran one thread per core and drifted from the 1 x 2 run from the first step."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import _metrics  # noqa: E402
from tests.train.conftest import ZERO3_RUN_ARGS  # noqa: E402
from tests.train.train_launch import VENV_BIN, _port, launch_env  # noqa: E402

pytestmark = pytest.mark.slow


def _tensors(run_dir: str, tag: str) -> dict:
    """Every tensor of every rank file of a checkpoint, by file and path inside it."""
    import torch

    from loongforge.train.ckpt.files import weights_only_loads

    out = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    root = os.path.join(run_dir, "checkpoints", tag)
    for name in sorted(os.listdir(root)):
        if name.endswith("_states.pt"):
            with weights_only_loads():
                walk(name, torch.load(os.path.join(root, name), map_location="cpu", weights_only=True))
    return out


def test_two_nodes_of_one_rank_train_the_weights_of_one_node_of_two(train_root, zero3_run, tmp_path):
    """zero3_run: 1 node x 2 ranks (ZeRO-3, 4 steps). The same arguments as 2 nodes x 1 rank, OMP_NUM_THREADS
    unset: bit-identical losses, sample ids and checkpointed weights and Adam moments."""
    root, _ = train_root
    run_dir = str(tmp_path / "run")
    env = launch_env()
    env.pop("OMP_NUM_THREADS")  # what a user's shell has: torchrun sets it for nproc_per_node > 1 only
    port = _port()
    procs = [subprocess.Popen([str(VENV_BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(n), "--nproc_per_node",
                               "1", "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "loongforge.train",
                               "--data", root, "--run-dir", run_dir, *ZERO3_RUN_ARGS], cwd=str(tmp_path), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    errs = [p.communicate(timeout=400)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    want, got = _metrics(zero3_run), _metrics(run_dir)
    assert [r["sample_ids"] for r in got] == [r["sample_ids"] for r in want]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # exactly
    mine, theirs = _tensors(run_dir, "step00000004"), _tensors(zero3_run, "step00000004")
    assert mine.keys() == theirs.keys() and mine
    assert [k for k in mine if not mine[k].equal(theirs[k])] == []
    assert "intra-op threads: 1 per rank" in errs[0]


def test_every_launch_path_gets_one_thread_unless_omp_num_threads_says_otherwise(monkeypatch):
    from loongforge.train.resilience.threads import intra_op_threads, launch_env as thread_env

    assert intra_op_threads({}) == 1
    assert intra_op_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert thread_env({"OMP_NUM_THREADS": "3"})["MKL_NUM_THREADS"] == "3"
    assert thread_env({})["OMP_NUM_THREADS"] == "1"  # the supervisor decides, not torchrun
