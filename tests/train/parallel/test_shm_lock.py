"""A rank killed while DeepSpeed's CPU accelerator compiled its shared-memory op left a lock
file in TORCH_EXTENSIONS_DIR, and every later launch on that machine waited on it forever
inside init_distributed (what stopped CI). Training must not depend on that build at all."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.train_launch import VENV_BIN, assert_ok, launch, read_metrics  # noqa: E402


def test_stale_extension_lock_does_not_hang_a_cpu_launch(train_root, tmp_path):
    root, _ = train_root
    ext = tmp_path / "torch_extensions"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "lock").write_text("")  # what a SIGKILLed compile leaves behind
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    proc = launch([str(VENV_BIN / "python"), "-m", "loongforge.train", "--data", root, "--run-dir", run_dir,
                   "--steps", "2", "--batch-size", "8", "--recipe", "tiny", "--no-ds-breakdown"],
                  cwd=str(tmp_path), timeout=180, env=env, warm=False)  # a fresh rank's own start-up
    assert_ok(proc)
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [0, 1]
    assert not (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()  # the op was not built
