"""A training sample's random draws: flow-matching noise, flow time, and where its images are cropped.

The noise (B, ...), the per-sample uniform u (B,) that the flow-matching loss of model.py consumes
and the two uniforms (B, 2) that place the training crop (train/data/processor.py) are a pure
function of (seed, epoch, global sample id): a sample draws the
same values whichever rank, micro batch or step trains it, so a resume on another rank count
(or batch layout) computes the same loss, and the ranks of one tensor-parallel group, which
read the same batch, agree without a broadcast. A sample is seen once per epoch, so
(epoch, id) never repeats a draw.
"""

from __future__ import annotations

import numpy as np
import torch


def noise_for(seed: int, epoch: int, sample_ids, shape, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise, u, crop) for the samples `sample_ids`, drawn on the CPU (B tiny generators; the
    tensors are small) and moved in one copy each."""
    noise = torch.empty(shape, dtype=torch.float32)
    u = torch.empty(shape[0], dtype=torch.float32)
    crop = torch.empty(shape[0], 2, dtype=torch.float32)
    g = torch.Generator()
    for i, sid in enumerate(np.asarray(sample_ids).tolist()):
        g.manual_seed(int(np.random.SeedSequence([seed, epoch, int(sid)]).generate_state(1)[0]))
        noise[i].normal_(generator=g)
        u[i:i + 1].uniform_(generator=g)
        crop[i].uniform_(generator=g)
    if device.type == "cuda":  # pin_memory() draws from torch's caching host allocator: no cudaHostAlloc per step
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in (noise, u, crop))
    return noise, u, crop
