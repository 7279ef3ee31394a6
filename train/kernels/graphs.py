"""CUDA graphs against launch overhead (`--cuda-graphs`), applied from outside the model.

The seed's "kernel launch and scheduling" slice is GPU idle inside the step while the host
dispatches: a block's forward and backward are dozens of small kernels, each launched from
Python. With `--cuda-graphs` every transformer block's forward (trunk and heads, the block
lists of checkpointing.block_lists) is compiled with torch.compile(mode="reduce-overhead"): inductor
fuses the elementwise work and CUDA graph trees record each block's forward and backward once
per shape, then replay them with one launch each. With `--fuse off` the backend is
"cudagraphs" (AOTAutograd + CUDA graph trees, no inductor fusion), so graphs and fusion can be
measured apart.

Why per block and not the whole model: like fusion.py, only the block's *forward* is
compiled, so DeepSpeed's module hooks and its gradient hooks (which fire when autograd
accumulates a parameter's .grad, outside the graph) stay eager, and the glue between blocks
(masks, embeddings, losses) keeps its data-dependent Python.

Where it composes with DeepSpeed, and where it is refused (check(), before any process group):
- ZeRO 0-2: parameters live in DeepSpeed's flat buffers from deepspeed.initialize on and are
  updated in place, so their addresses are stable, as graph replay needs (compilation is lazy:
  the first forward, after initialize, records them);
- ZeRO-3 is refused: its hooks gather each parameter before use and free it after, so the
  storage a graph recorded is gone at the next replay;
- activation checkpointing is refused: the recompute re-runs the graphed forward inside the
  backward, which CUDA graph trees do not replay (they fall back or re-record);
- tensor parallelism is refused: the blocks then hold collectives, which need NCCL's graph-safe
  mode and per-graph communicators, not set up here;
- CPU is refused: there is nothing to graph, and the CPU breakdown's launch/dispatch share is
  measured from host time instead (profiler.py).
Shapes: the loader's frame buckets keep the shapes to a small fixed set (dynamic=False), so
each bucket records its graphs once; a new bucket costs one recording, then replays.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.kernels.checkpointing import block_lists

log = logging.getLogger(__name__)


def check(*, device: torch.device, zero_stage: int, ac_every: int, tp: int) -> None:
    """Raise ConfigError where `--cuda-graphs` cannot work (module docstring), naming the fix."""
    if device.type != "cuda":
        raise ConfigError(f"memory.cuda_graphs: --cuda-graphs needs a CUDA device, this run is on {device.type} "
                          "(CUDA graphs replay GPU kernels; on CPU the breakdown's launch/dispatch share is "
                          "host time). Drop --cuda-graphs, or run with --device cuda on a GPU")
    if zero_stage == 3:
        raise ConfigError("memory.cuda_graphs: --cuda-graphs does not compose with ZeRO-3 (its hooks gather and "
                          "free parameters around every block, so a recorded graph would read freed memory); "
                          "use --zero 2 or drop --cuda-graphs")
    if ac_every:
        raise ConfigError("memory.cuda_graphs: --cuda-graphs does not compose with --ac-every (the recompute "
                          "re-runs the graphed forward inside the backward); use --ac-every 0 or drop --cuda-graphs")
    if tp > 1:
        raise ConfigError("memory.cuda_graphs: --cuda-graphs does not compose with --tp > 1 (collectives inside "
                          "the blocks); use --tp 1 or drop --cuda-graphs")


def compile_options(fuse: str) -> dict:
    """torch.compile arguments for graphed blocks: inductor's reduce-overhead mode, or the plain
    cudagraphs backend when fusion is switched off."""
    if fuse == "off":
        return {"backend": "cudagraphs", "mode": None}
    return {"backend": "inductor", "mode": "reduce-overhead"}


def own_grads(model: nn.Module) -> int:
    """Make every gradient of a graphed block a tensor of its own; returns how many parameters.

    A graphed backward returns parameter gradients in the graph's private memory pool, and
    AccumulateGrad keeps such a tensor as `.grad`: the next replay (the next micro-step) writes
    over it. ZeRO-2 copies each gradient into its buckets during the backward, but ZeRO 0/1 and
    --grad-accum > 1 keep `.grad` until the optimizer step, and CUDA graph trees then fail with
    "accessing gradient tensor output of CUDAGraphs that has been overwritten". A hook that clones
    the incoming gradient (one copy of each block gradient per micro-step, from the caching
    allocator) keeps every ZeRO stage and accumulation exact."""
    n = 0
    for _, blocks in block_lists(model):
        for p in blocks.parameters():
            if p.requires_grad:
                p.register_hook(_own)
                n += 1
    return n


def _own(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


def mark_step_begin() -> None:
    """Before each micro-step's forward: tells CUDA graph trees a new iteration starts, so the
    previous one's graph outputs (all consumed by then) may be overwritten by the next replay.
    Without it the trees infer iterations from the backward, and an output still referenced
    across steps would make them re-record instead of replaying."""
    torch.compiler.cudagraph_mark_step_begin()
