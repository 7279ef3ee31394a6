"""Dropout whose mask is a function of (seed, epoch, sample id) only, applied from outside the model.

torch's nn.Dropout draws from the device's generator, whose stream depends on how many samples the
rank's batch holds and what ran before: a run that changes its rank layout (an elastic 2 -> 1 -> 2
ranks, a resume on another world size, another micro-batch split) draws other masks and trains other
weights. `apply_sample_dropout(model)` swaps every nn.Dropout with p > 0 for `SampleDropout`: the mask
of sample b at element i of module m is a counter-based hash of (the sample's key, m, i), computed on
the activation's own device, so any layout, any micro-batch and activation checkpointing's recompute
draw the same mask. The sample keys come from the trainer each micro-step (`SampleKeys.set`: one int64
per row, from model/noise.py's per-sample seed). Without keys set (a bare forward in a test, inference
in train mode) a module falls back to torch's dropout.

The hash: three rounds of x = ((x >> 16) ^ x) * 0x45d9f3b mod 2^32 over (key + m * C1 + i), kept in int64
so every product stays below 2^63 on every device (no reliance on wrap-around).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^31: (x < 2^32) * _MUL < 2^63
_MODULE = 0x9E3779B1  # spreads module ids over the 32-bit space (golden ratio)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _MASK32
    return (x >> 16) ^ x


class SampleKeys:
    """The current micro-batch's per-sample keys, shared by every SampleDropout of a model. One tensor
    on the model's device, refilled in place while the batch size stays (a compiled block sees the same
    input every step: no recompile)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None  # (B,) int64, < 2^32

    def set(self, keys: torch.Tensor | None, device=None) -> None:
        if keys is None:
            self.keys = None
            return
        keys = keys.to(device or keys.device, dtype=torch.int64, non_blocking=True) & _MASK32
        if self.keys is not None and self.keys.shape == keys.shape and self.keys.device == keys.device:
            self.keys.copy_(keys)
        else:
            self.keys = keys.clone()


class SampleDropout(nn.Module):
    def __init__(self, p: float, module_id: int, keys: SampleKeys):
        super().__init__()
        self.p, self.module_id, self.shared = p, module_id, keys

    def extra_repr(self) -> str:
        return f"p={self.p}, module_id={self.module_id}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.shared.keys
        if not self.training or self.p == 0:
            return x
        if keys is None or keys.numel() != x.shape[0]:
            return F.dropout(x, self.p, True)
        n = x[0].numel()
        idx = torch.arange(n, device=x.device, dtype=torch.int64)
        base = (keys + (self.module_id * _MODULE)) & _MASK32
        u = _hash32((base[:, None] + idx[None, :]) & _MASK32)  # (B, n), uniform over 32 bits
        keep = (u >= int(self.p * 2**32)).view(x.shape)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


def apply_sample_dropout(model: nn.Module) -> tuple[SampleKeys, list[str]]:
    """Swap every nn.Dropout (p > 0) under `model` for a SampleDropout; returns the keys holder and the
    swapped modules' names (module ids are their order, the same on every rank)."""
    keys, swapped = SampleKeys(), []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, SampleDropout(child.p, len(swapped) + 1, keys))
                swapped.append(full)
    return keys, swapped


def sample_keys(seed: int, epoch: int, sample_ids, stream: int = 0) -> torch.Tensor:
    """(B,) int64 keys of the samples: a hash of (seed, epoch, stream, id), on the CPU."""
    k = torch.tensor([seed & _MASK32], dtype=torch.int64)
    for part in (epoch, stream):
        k = _hash32(_hash32(k) ^ (part & _MASK32))
    ids = torch.as_tensor(list(sample_ids), dtype=torch.int64)
    return _hash32(_hash32(ids & _MASK32) ^ k ^ ((ids >> 32) & _MASK32))
