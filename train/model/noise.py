"""A training sample's random draws: flow-matching noise and time, a crop offset (callers that crop
without colour jitter; the trainer's crop and jitter are data/images.py's `image_draws`), and whether
its state is dropped (N1.6's state dropout).

Every draw is a pure function of (seed, epoch, global sample id): a sample draws the same values
whichever rank, micro batch or step trains it, so a resume on another rank count (or batch layout)
computes the same loss, and the ranks of one tensor-parallel group, which read the same batch, agree
without a broadcast. A sample is seen once per epoch, so (epoch, id) never repeats a draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Draws:
    noise: torch.Tensor  # (B, H, D) ~ N(0, 1): the flow's starting point
    u: torch.Tensor  # (B,) uniform: the flow time (model.flow_time)
    crop: torch.Tensor  # (B, 2) uniform: a crop offset (y, x) (processor.py's crop_u)
    state_dropout: torch.Tensor  # (B,) uniform: a sample's state is dropped where this < state_dropout_prob

    def __iter__(self):  # (noise, u, crop): what callers that need only the flow and the crop unpack
        return iter((self.noise, self.u, self.crop))


def noise_for(seed: int, epoch: int, sample_ids, shape, device, stream: int = 0) -> Draws:
    """The draws of the samples `sample_ids`, made on the CPU (B tiny generators; the tensors are
    small) and moved in one copy each. `stream`: the root of a mixture (ids are per root)."""
    noise = torch.empty(shape, dtype=torch.float32)
    u = torch.empty(shape[0], dtype=torch.float32)
    crop = torch.empty(shape[0], 2, dtype=torch.float32)
    drop = torch.empty(shape[0], dtype=torch.float32)
    g = torch.Generator()
    for i, sid in enumerate(np.asarray(sample_ids).tolist()):
        key = [seed, epoch, int(sid)] if not stream else [seed, epoch, int(sid), stream]
        g.manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
        noise[i].normal_(generator=g)
        u[i:i + 1].uniform_(generator=g)
        crop[i].uniform_(generator=g)
        drop[i:i + 1].uniform_(generator=g)  # drawn after the others: their values stay what they were
    out = (noise, u, crop, drop)
    if device.type == "cuda":  # pin_memory() draws from torch's caching host allocator: no cudaHostAlloc per step
        out = tuple(t.pin_memory().to(device, non_blocking=True) for t in out)
    return Draws(*out)
