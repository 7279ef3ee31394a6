"""Resume across a layout change that DeepSpeed cannot load directly (ZeRO-3 on
either side: parameters and optimizer state are partitioned by rank count).

The checkpoint is converted once with DeepSpeed's own converter
(`deepspeed.checkpoint.ds_to_universal`: one folder per parameter holding the
fp32 weight and both Adam moments) into `stepNNNNNNNN_universal/`, then loaded
with DeepSpeed's `load_universal` path, which slices every tensor for the new
rank count and stage: weights, Adam moments and the step are all kept.

The converter calls torch.load(weights_only=False); it runs in a child process
(`python -m loongforge.train.ckpt.universal SRC DST`) under the same
weights-only guard as every other load, after the manifest was verified.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from loongforge.train.ckpt.fallback import raise_unless_rank0_ok
from loongforge.train.ckpt.files import weights_only_loads

log = logging.getLogger(__name__)
SUFFIX = "_universal"


def convert_command(src: str) -> str:
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {src} "
            f"--output_folder {src}{SUFFIX}")


def ensure_universal(src: str, *, rank: int, device: torch.device, timeout_s: float = 1800.0) -> str:
    """Rank 0 converts `src` (once; an existing conversion is reused); every rank returns the folder.
    Collective: a failed conversion raises CheckpointError on every rank, none waits forever."""
    dst = src.rstrip("/") + SUFFIX
    err = ""
    if rank == 0 and not os.path.isdir(dst):
        err = _convert(src, dst, timeout_s)
    raise_unless_rank0_ok(err, device=device, failed=f"converting {src} to a universal checkpoint failed",
                          hint=f"try it by hand: {convert_command(src)}")
    return dst


def _convert(src: str, dst: str, timeout_s: float) -> str:
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s to a universal checkpoint (DeepSpeed ds_to_universal) for the new layout", src)
    err = run_converter([src, tmp], timeout_s)
    # The converter also writes `latest_universal` beside its output; that pointer is not ours.
    latest_u = os.path.join(os.path.dirname(dst), "latest_universal")
    if os.path.exists(latest_u):
        os.unlink(latest_u)
    if err:
        shutil.rmtree(tmp, ignore_errors=True)
        return err
    os.replace(tmp, dst)
    return ""


def run_converter(pairs: list[str], timeout_s: float) -> str:
    """DeepSpeed's converter on (src, dst) pairs, in a child process: '' or its last stderr line. The child
    is a fresh interpreter (`python -m loongforge.train.ckpt.universal`), except in a process that already
    imported the converter and may still fork (one thread, no CUDA): the elastic supervisor's warm
    conversion child (train/warm.py), where a fork gives the same isolation without importing torch and
    DeepSpeed again (~1.5x a bare `import torch`, on the path of a restart that changes the rank count)."""
    if _DS_TO_UNIVERSAL in sys.modules and _single_threaded():
        return _forked(pairs, timeout_s)
    env = dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "loongforge.train.ckpt.universal", *pairs], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f}s"
    return "" if proc.returncode == 0 else _last_line(proc.stderr, proc.returncode)


_DS_TO_UNIVERSAL = "deepspeed.checkpoint.ds_to_universal"


def _single_threaded() -> bool:
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return threads == 1 and not torch.cuda.is_initialized()


def _forked(pairs: list[str], timeout_s: float) -> str:
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: main() under the weights-only guard, its stderr to `err`, never returns
            code = 1
            try:
                os.dup2(err.fileno(), 2)
                os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
                code = main(pairs)
            except BaseException as exc:  # noqa: BLE001 - one line for the caller, as the subprocess gives
                print(f"{type(exc).__name__}: {' '.join(str(exc).split())[:480]}", file=sys.stderr)
            finally:
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"timed out after {timeout_s:.0f}s"
            time.sleep(0.05)
        code = os.waitstatus_to_exitcode(done[1])
        err.seek(0)
        return "" if code == 0 else _last_line(err.read().decode(errors="replace"), code)


def _last_line(stderr: str, code: int) -> str:
    return (stderr.strip().splitlines() or [f"exit code {code}"])[-1][:500]


def load_universal(engine, root: str, tag: str):
    """DeepSpeed's load_universal path for one load only (it reads the flag at load time)."""
    engine._config.load_universal_checkpoint = True
    try:
        with weights_only_loads():
            return engine.load_checkpoint(root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    finally:
        engine._config.load_universal_checkpoint = False


def main(argv: list[str] | None = None) -> int:
    from deepspeed.checkpoint import ds_to_universal  # heavy; this runs in the converter's child process

    args = argv if argv is not None else sys.argv[1:]
    for src, dst in zip(args[::2], args[1::2]):  # several pairs: one interpreter, DeepSpeed imported once
        sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", dst, "--num_extract_workers", "1",
                    "--num_merge_workers", "1"]
        with weights_only_loads():
            ds_to_universal.main(ds_to_universal.parse_arguments())
    return 0


if __name__ == "__main__":
    sys.exit(main())
