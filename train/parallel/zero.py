"""Where the plan meets DeepSpeed ZeRO (0.19.8), checked on gloo by tests/train/parallel/test_zero.py.

* ZeRO shards over `mpu.get_sequence_data_parallel_group()` = the plan's sp_dp
  group: SP ranks hold different tokens of the same samples and must sum their
  gradients, DP replicas average theirs. ZeRO-3 also needs the parameters
  partitioned over that group at construction (`partition_zero3`), otherwise
  DeepSpeed partitions over the pure DP group and SP ranks never reduce.
* The reduction DeepSpeed applies over sp_dp (W = S*D ranks):
      ZeRO-1/2            divides by W/S before the sum   -> sum over SP, mean over DP (what we want)
      ZeRO-3, reduce_scatter (default): reduce_scatter_coalesced averages over W -> 1/S too small
  so with ZeRO-3 the loss handed to `engine.backward` is multiplied by S
  (`zero_loss_scale`). ZeRO-3 with reduce_scatter=false takes either path
  depending on each bucket's size (stage3.py), so a mixed scale could result:
  that setting is refused.
* TP shards carry `tensor_model_parallel=True` (tensor_parallel.py), so the
  global gradient norm counts each shard once and replicated parameters once.
"""

from __future__ import annotations

import io
import os

import torch

from loongforge.shared.errors import CheckpointError, ConfigError
from loongforge.train.config import TrainConfig
from loongforge.train.parallel.compression import CompressionConfig, TopKCompressor


def zero_loss_scale(zero_config: dict, state) -> float:
    """Factor for the loss given to engine.backward so ZeRO's reduction over sp_dp yields
    the single-process gradient (sum over SP, mean over DP)."""
    stage = zero_config.get("stage", 0)
    if stage != 3:
        return 1.0
    if not zero_config.get("reduce_scatter", True):
        raise ConfigError("zero_optimization.reduce_scatter=false with ZeRO-3 and sequence parallel: DeepSpeed "
                          "then averages some buckets over SP and sums others; keep reduce_scatter=true")
    return float(state.size("sp"))


def partition_zero3(model, state, conf: dict) -> None:
    """Partition an already built (TP-swapped) model for ZeRO-3 over the shard group (sp_dp, or sp),
    its parameters in the engine's dtype (`conf`: the DeepSpeed config the engine is built from)."""
    import deepspeed  # heavy; only the paths that build an engine import it

    dtype = engine_dtype(conf)
    # NOTE: deepspeed.initialize casts the parameters to bf16 only for a model that was not ZeRO-Init'ed
    # (DeepSpeed 0.19.8, engine._cast_module_mixed_precision), and zero.Init(module=...) partitions each
    # parameter in the dtype it has: without this cast a TP/SP/hybrid run trains its fp32 weights (no
    # bf16 GEMMs, twice the memory, flash-attn refused), silently. Parameters only, as the engine casts.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=model, data_parallel_group=state.get_sequence_data_parallel_group(), mpu=state)


def keep_vectors_gathered(conf: dict, model) -> None:
    """ZeRO-3's persistence threshold (parameters of at most this many elements stay gathered between
    uses), set to the model's largest 1-D parameter: every norm weight and bias persists, at a few KB
    each, instead of one all-gather and one free per tensor, per layer, per step (a threshold of 0);
    the weight matrices, each larger than any vector of the model, stay partitioned. Applied when
    deepspeed.initialize reads the config; partitioned (zero.Init) parameters report ds_numel/ds_shape."""
    zero = conf["zero_optimization"]
    if zero.get("stage") != 3:
        return
    vectors = [int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()
               if len(getattr(p, "ds_shape", p.shape)) == 1]
    zero["stage3_param_persistence_threshold"] = max(vectors, default=0)


def engine_dtype(conf: dict) -> torch.dtype:
    """The dtype DeepSpeed trains the module's parameters in, from its config."""
    if conf.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if conf.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def compressed_dp_sync(model, compressor, *, dense: bool = False) -> None:
    """Hybrid sharding's replica sync, between engine.backward() and engine.step(): ZeRO-3
    (zero_shard="sp") has reduced the gradients inside the shard group; each rank now holds
    its gradient partition, which the compressor averages with the same partition on the
    other DP replicas (top-k + error feedback, or dense where the cost model says so)."""
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad  # heavy, as above

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [safe_get_local_grad(p) for p in params]
    compressor.reduce_(grads, dense=dense)
    for p, g in zip(params, grads):
        safe_set_local_grad(p, g)


class CompressedDPSync:
    """Hybrid sharding's replica sync, called between engine.backward() and engine.step(): at the
    accumulation boundary ZeRO-3 has reduced the gradients inside the shard group, and each rank's
    partition is averaged with the other DP replicas' by top-k + error feedback (compressed_dp_sync).
    The residuals are per rank and saved beside the checkpoint (`blobs`, `load`), so a resume is exact."""

    def __init__(self, cfg: TrainConfig, state, engine):
        self.engine, self.rank = engine, torch.distributed.get_rank()
        self.warmup_steps = cfg.parallel.compress_warmup_steps
        self.compressor = TopKCompressor(CompressionConfig(wire_fraction=1.0 / cfg.parallel.compress_ratio),
                                         state.group("dp"))

    @classmethod
    def for_config(cls, cfg: TrainConfig, state, engine) -> "CompressedDPSync | None":
        return cls(cfg, state, engine) if cfg.parallel.grad_compression == "topk" else None

    def __call__(self) -> None:
        if self.engine.is_gradient_accumulation_boundary():
            # engine.global_steps: optimizer steps done, restored on resume, so warm-up survives a restart
            dense = self.engine.global_steps < self.warmup_steps
            compressed_dp_sync(self.engine.module, self.compressor, dense=dense)

    def _name(self) -> str:
        return f"compressor_rank{self.rank}.pt"

    def blobs(self) -> tuple[tuple[str, bytes], ...]:
        """This rank's residuals for the checkpoint writer (checkpoint.Checkpointer.save(blobs=...)):
        written and hashed with the rest of the tag, before the `latest` pointer moves."""
        buf = io.BytesIO()
        torch.save(self.compressor.state_dict(), buf)
        return ((self._name(), buf.getvalue()),)

    def load(self, tag_dir: str) -> None:
        """The residuals this rank saved into checkpoint directory `tag_dir`."""
        path = os.path.join(tag_dir, self._name())
        try:
            # NOTE: to the host first: residuals written from cuda:3 would otherwise be restored to
            # cuda:3, which a resuming rank that sees one GPU (or its GPU under another index) lacks;
            # the compressor moves them to the gradients' device on first use.
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path} missing: the checkpoint was written without --grad-compression topk "
                                  "(or by another rank count); resume with the flags that wrote it") from None
        self.compressor.load_state_dict(sd)
