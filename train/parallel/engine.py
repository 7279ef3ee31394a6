"""DeepSpeed's side of a run: the device, the process group (setup and teardown), the JSON config
the engine is built from (generated from the typed config, never written by hand), per-step
communication time, and the /dev/shm segments DeepSpeed leaves behind. The engine itself is
built by parallelize.py; the model knows nothing of any of this.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import sys
import warnings
from datetime import timedelta

import torch

from loongforge.shared.errors import ConfigError
from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.config import TrainConfig

log = logging.getLogger(__name__)
# DeepSpeed 0.19 gathers with torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates: a
# FutureWarning and its source line from every rank at every launch, for a call that is DeepSpeed's to change.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


def pick_device(requested: str) -> torch.device:
    """The run's device, the one choice DeepSpeed then follows (align_ds_accelerator). `auto` is
    CUDA when torch sees a GPU; each rank takes the GPU of its LOCAL_RANK, and a rank without one
    is refused: two ranks sharing one GPU would each hold a full replica and NCCL rejects it."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device: cuda requested but torch.cuda.is_available() is False; use --device cpu")
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:
            raise ConfigError(f"run.device: local rank {local} needs cuda:{local} but this machine has {count} "
                              f"CUDA device(s); launch at most {count} rank(s) per node (--nproc_per_node "
                              f"{count}) or train on CPU with --device cpu")
        return torch.device("cuda", local)
    return torch.device("cpu")


def align_ds_accelerator(device: torch.device) -> str:
    """Make DeepSpeed's accelerator the trainer's device; returns its name.

    DeepSpeed picks its accelerator on import (DS_ACCELERATOR, else CUDA when visible, else CPU)
    and places the engine on that accelerator's device: a DS_ACCELERATOR=cpu inherited on a GPU
    machine would put the model on CPU while batches go to CUDA. The trainer's device wins; the
    variable is set for the processes this one starts (checkpoint writers, ...)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator  # heavy, as in init_distributed

    inherited = os.environ.get("DS_ACCELERATOR")
    if inherited and inherited != device.type:
        log.warning("DS_ACCELERATOR=%s overridden: this run trains on %s (run.device); pass --device %s to "
                    "train there", inherited, device, inherited)
    os.environ["DS_ACCELERATOR"] = device.type
    if get_accelerator().device_name() != device.type:
        if device.type == "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accel  # heavy, as above
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accel  # heavy, as above
        set_accelerator(Accel())
    return get_accelerator().device_name()


# ZeRO-3 leaf modules (--zero3-leaf-blocks): N1.6's blocks, one parameter fetch per block.
LEAF_BLOCKS = ("transformers.models.siglip2.modeling_siglip2.Siglip2EncoderLayer",
               "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer",
               "loongforge.train.model.dit.BasicTransformerBlock")


def ds_config(cfg: TrainConfig, *, world: int, device: torch.device) -> dict:
    """The DeepSpeed JSON, from the typed config. One place, so it can be printed and diffed."""
    p, o = cfg.parallel, cfg.optim
    step_batch = cfg.data.global_batch_size
    micro = step_batch // (world * p.grad_accum)
    if micro * world * p.grad_accum != step_batch:
        raise ConfigError(f"data.global_batch_size: {step_batch} must equal micro batch x {world} data-parallel "
                          f"ranks x {p.grad_accum} accumulation steps; pick a multiple of {world * p.grad_accum}")
    cuda = device.type == "cuda"
    bf16 = p.precision == "bf16" or (p.precision == "auto" and cuda)
    zero = {"stage": p.zero_stage, "reduce_bucket_size": p.reduce_bucket_size, "overlap_comm": p.overlap_comm,
            "contiguous_gradients": True, "allgather_bucket_size": p.reduce_bucket_size}
    if p.zero_stage == 3:
        zero.pop("allgather_bucket_size")
        # stage3_param_persistence_threshold is set from the built model (zero.keep_vectors_gathered).
        zero.update({"stage3_prefetch_bucket_size": p.reduce_bucket_size})
        if p.zero3_leaf_blocks:  # one gather and one hook pair per block instead of per sub-layer
            zero["leaf_module"] = {"classes": list(LEAF_BLOCKS)}
    conf = {
        "train_batch_size": step_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": p.grad_accum,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": 1e-8,
                                                  "weight_decay": o.weight_decay, **_adam_impl(cuda)}},
        "wall_clock_breakdown": p.wall_clock_breakdown,
        # Enabled so deepspeed.comm times every collective (see comm_seconds). On CUDA the logger
        # synchronizes after each op, which would serialize overlap_comm: there NCCL time comes from traces.
        "comms_logger": {"enabled": not cuda, "prof_all": True, "verbose": False},
        "steps_per_print": 1 << 30,
    }
    # No "scheduler" entry: the schedule is our client scheduler (lr_schedule.py, given in parallelize).
    return conf


def _adam_impl(cuda: bool) -> dict:
    """Which AdamW DeepSpeed builds. Never one that needs an op compiled at run time: its CPU Adam
    costs a ~40 s g++ build, and on CUDA its FusedAdam JIT-builds with nvcc + CUDA_HOME + ninja,
    which pip's torch does not ship (a fresh GPU box fails, or compiles for minutes). torch's own
    AdamW (`torch_adam`; fused kernel on CUDA) needs no build. A DeepSpeed installed with the op
    prebuilt (DS_BUILD_FUSED_ADAM=1) keeps its FusedAdam."""
    if cuda and fused_adam_prebuilt():
        return {}
    return {"torch_adam": True, **({"fused": True} if cuda else {})}


def fused_adam_prebuilt() -> bool:
    try:
        from deepspeed.git_version_info import installed_ops  # heavy, as in init_distributed
    except ImportError:
        return False
    return bool(installed_ops.get("fused_adam"))


def skip_cpu_shm_op(deepspeed) -> None:
    """Keep DeepSpeed's CPU accelerator from compiling its shared-memory all-reduce op.

    On the first `deepspeed.init_distributed` of a machine the CPU accelerator JIT-builds that op
    (used only by `inference_all_reduce`; training collectives go through torch.distributed) under
    a file lock in TORCH_EXTENSIONS_DIR. A rank killed while it compiles (a fault test, a launcher
    timeout, Ctrl-C) leaves the lock behind, and every later launch on that machine then waits on
    it forever inside init_distributed. Marking the op incompatible skips the build and the lock."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# DeepSpeed's module of its Muon optimizer: its ZeRO optimizers import it on every run, to recognise a Muon
# optimizer, and it decorates its Newton-Schulz kernel with @torch.compile when imported.
_DS_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon module with dynamo off, so that its @torch.compile at import leaves the
    function as it is instead of loading torch's inductor compiler (its codecache, FX passes, autotuning,
    redis client and OpenTelemetry: ~1.5x a bare `import torch`, in every rank of every launch and
    restart). This trainer's optimizer is always AdamW (ds_config): Muon's kernel never runs here; a
    Muon run in this process would run it eagerly (same numbers). TORCHDYNAMO_DISABLE is read by
    torch.compile at the call, and restored at once."""
    if _DS_MUON in sys.modules:
        return
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(_DS_MUON)
    except ImportError:  # a DeepSpeed without Muon: nothing to keep from compiling
        pass
    finally:
        if saved is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    import deepspeed  # heavy (seconds, and its accelerator probe): only a training process pays it

    import_muon_uncompiled()

    # Single-process runs (no launcher) still get a 1-rank group, so the code path is one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    align_ds_accelerator(device)
    skip_cpu_shm_op(deepspeed)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False,
                               timeout=timedelta(seconds=timeout_s))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(full, local) parameter elements: under ZeRO-3 `p.numel()` is 0 and `ds_numel` is the full size."""
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    local = sum(int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    return full, local


def comm_seconds() -> float:
    """Seconds spent inside deepspeed.comm collectives since the last call (then reset).

    Read from deepspeed.comm's per-op timers directly: its comms logger records
    the cumulative timer value per op (elapsed(reset=False)), not each op's own
    latency, so summing the logger's list would over-count."""
    from deepspeed.comm import comm as dscomm  # heavy, as in init_distributed

    total = 0.0
    for t in list(dscomm.timers.get_timers().values()):
        if t.started_:
            continue
        for et in t.event_timers:
            total += et if isinstance(et, float) else et.get_elapsed_msec() / 1000.0
        t.reset()
    return total


def write_ds_config(conf: dict, run_dir: str) -> None:
    write_bytes_atomic(os.path.join(run_dir, "ds_config.json"), json.dumps(conf, indent=2, sort_keys=True).encode())


def shutdown(barrier: bool = True) -> None:
    """destroy_process_group: without it gloo processes sometimes abort at exit. After a failure
    pass barrier=False: peers may be gone, and a barrier could hang."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if barrier:
            try:
                torch.distributed.barrier()
            except Exception as exc:  # noqa: BLE001 - a peer may already be gone; still tear down
                log.warning("barrier at shutdown failed: %s", exc)
        world = torch.distributed.get_world_size()
        torch.distributed.destroy_process_group()
        release_cpu_shm_buffers(world)


# DeepSpeed's CPU shm allreduce (all ranks on one host) maps one ~66 MB /dev/shm segment per rank
# and never unlinks it (deepspeed/ops/csrc/cpu/comm/shm.cpp, name below): every CPU run would leave
# 66 MB x ranks of RAM behind. At teardown every rank is past its last collective, or dead, and a
# segment a peer still maps stays valid after the unlink, so each rank removes all of them.
_DS_SHM = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def release_cpu_shm_buffers(world: int) -> int:
    """Unlink this launch's DeepSpeed CPU allreduce segments; returns how many were removed."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        return 0
    removed = 0
    for rank in range(world):
        try:
            os.unlink(_DS_SHM.format(uid=os.getuid(), addr=addr, port=port, rank=rank))
            removed += 1
        except FileNotFoundError:
            pass  # not a CPU run, or a peer removed it first
        except OSError as exc:
            log.warning("could not remove DeepSpeed's shm allreduce buffer of rank %d: %s", rank, exc)
    return removed
