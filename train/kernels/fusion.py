"""Kernel fusion of the transformer blocks, applied from outside the model.

Each block's forward is compiled with torch.compile (inductor): the residual
add, LayerNorm, dropout and activation around the GEMMs and attention become a
few fused Triton kernels instead of one eager kernel each (norm + residual +
dropout is the seed's "-18% kernel time"). Only the block's *forward* is
compiled, not its `__call__`: module hooks (DeepSpeed's) stay outside the
compiled region, and activation checkpointing (checkpointing.py, applied after this)
wraps the compiled forward.

Policy: on by default only on CUDA with ZeRO < 3 and no tensor or sequence
parallelism. On CPU inductor would need a C++ toolchain and a long compile for
no measured gain here; under ZeRO-3 the parameters are gathered by hooks on the
Linear submodules inside the block, which break the graph at every layer (use
DeepSpeed's own engine.compile there, not wired yet); under TP or SP the blocks
hold collectives (the row-parallel all-reduce, the Ulysses all-to-alls), which
break the graph too and recompile per layout. `--fuse on` forces it (preflight
refuses it with TP or SP), `--fuse off` disables it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loongforge.train.kernels.checkpointing import block_lists

log = logging.getLogger(__name__)
_EAGER = "_loongforge_eager_forward"


def fusion_wanted(mode: str, device: torch.device, zero_stage: int, *, model_parallel: int) -> bool:
    """`model_parallel`: tp x sp of the run (1 without tensor or sequence parallelism)."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return device.type == "cuda" and zero_stage < 3 and model_parallel == 1


def apply_fusion(model: nn.Module, *, backend: str = "inductor", dynamic: bool | None = None,
                 mode: str | None = None) -> list[str]:
    """Compile the forward of every block of every block list; returns their paths.
    mode="reduce-overhead": CUDA graphs as well (graphs.py, --cuda-graphs).

    dynamic=None (automatic): the first shapes compile static; a dimension seen to change (the
    token count of another frame bucket) recompiles once as symbolic and then covers every
    bucket. Not dynamic=False: dynamo's recompile limit (8) counts per code object, and all blocks
    of a class share one (TrunkBlock.forward; HeadBlock.forward for self/cross, conditioned or
    not, in both heads), so variants x buckets passed it and the blocks fell back to eager."""
    done = []
    for path, blocks in block_lists(model):
        for i, blk in enumerate(blocks):
            if _EAGER in blk.__dict__:
                continue
            eager = blk.forward
            blk.__dict__[_EAGER] = eager
            blk.__dict__["forward"] = torch.compile(eager, backend=backend, dynamic=dynamic, mode=mode)
            done.append(f"{path}.{i}")
    return done
