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

from loongforge.shared.errors import ConfigError


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


def partition_zero3(model, state) -> None:
    """Partition an already built (TP-swapped) model for ZeRO-3 over the shard group (sp_dp, or sp)."""
    import deepspeed

    deepspeed.zero.Init(module=model, data_parallel_group=state.get_sequence_data_parallel_group(), mpu=state)


def compressed_dp_sync(model, compressor) -> None:
    """Hybrid sharding's replica sync, between engine.backward() and engine.step(): ZeRO-3
    (zero_shard="sp") has reduced the gradients inside the shard group; each rank now holds
    its gradient partition, which the compressor averages with the same partition on the
    other DP replicas (top-k + error feedback, or dense where the cost model says so)."""
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [safe_get_local_grad(p) for p in params]
    compressor.reduce_(grads)
    for p, g in zip(params, grads):
        safe_set_local_grad(p, g)
