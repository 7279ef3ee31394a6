"""Precision policies, applied to a built model from outside (pytorch/ao's module swap).

BF16: DeepSpeed's bf16 mode (engine.ds_config) casts the module to bf16 and
keeps fp32 master weights and Adam moments in the optimizer; residual adds,
norms and softmax therefore run in bf16. CPU trains in fp32 ("auto").

FP8: torchao's `convert_to_float8_training` swaps the selected nn.Linear for
Float8Linear (same parameter objects and names: a BF16 checkpoint loads as is,
ZeRO-3 partitions the same tensors). The filter keeps high precision where FP8
hurts or cannot help: linears outside the transformer block lists (embeddings'
projections, heads), the first and last block of each list, and GEMMs whose
dims are not multiples of 16 (torch._scaled_mm's constraint) or are small.
The filter sees only the features; the third dimension, tokens (batch x
sequence), is the inner dimension of the weight-gradient GEMM and changes with
the recipe and micro batch (161 tokens x 8 = 1,288), so torchao pads inner
dimensions to 16 (`pad_inner_dim`, see fp8_config).

Warm-up: torchao 0.18 has only dynamic scaling and no warm-up of its own, and
the FP8 loss sits above the BF16 one for a while after the switch. So the
converted linears start in high precision and blend to FP8 over
`warmup_steps` (y = hp + a * (fp8 - hp), a rising 0 -> 1; mode "switch" jumps
at the end instead). The ramp counts from the first step this process trains
(the resume step), so `--resume` from a BF16 checkpoint with `--fp8` warms up
from there. Once a = 1 the blend is removed and Float8Linear runs alone.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.shared.errors import ConfigError
from loongforge.train.kernels.checkpointing import block_lists

log = logging.getLogger(__name__)
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: torch._scaled_mm
_MIX = "_loongforge_fp8_mix"
_MIX_ON = "_loongforge_fp8_mix_on"


def train_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def check_fp8_supported(device: torch.device) -> None:
    """Raise ConfigError saying why FP8 cannot run here, and what to do."""
    try:
        import torchao.float8  # noqa: F401  - optional extra loongforge[fp8]
    except ImportError as exc:
        raise ConfigError(f"--fp8: torchao is not installed ({exc}); `pip install 'loongforge[fp8]'` "
                          "(torchao 0.18 for torch 2.13) or drop --fp8") from None
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"--fp8: {name} has compute capability {cap[0]}.{cap[1]}; FP8 GEMMs "
                              f"(torch._scaled_mm) need >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                              "(Ada, Hopper or newer); train in BF16 (drop --fp8)")
    elif device.type == "cpu":
        log.warning("--fp8 on CPU: torch._scaled_mm runs a slow reference kernel; use it for tests only")


def fp8_filter(model: nn.Module, *, min_features: int = 256):
    """module_filter_fn for convert_to_float8_training: (module, fqn) -> convert?"""
    inner: set[str] = set()
    for path, blocks in block_lists(model):
        for i, blk in enumerate(blocks):
            if 0 < i < len(blocks) - 1:  # first and last block stay in high precision
                inner.add(f"{path}.{i}.")

    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        if not any(fqn.startswith(p) for p in inner):
            return False  # heads, input projections, first/last block
        if ".norm" in fqn:
            return False  # an adaptive norm's modulation (the DiT's norm1.linear): one row per sample, no GEMM to win

        i, o = mod.in_features, mod.out_features
        return i % 16 == 0 and o % 16 == 0 and min(i, o) >= min_features

    return keep


def convert_fp8(model: nn.Module, *, recipe: str = "tensorwise", min_features: int = 256,
                device: torch.device | None = None) -> list[str]:
    """Swap the filtered linears for torchao Float8Linear in place; returns their names."""
    if device is not None:
        check_fp8_supported(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional, as above
    from torchao.float8.float8_linear import Float8Linear

    keep = fp8_filter(model, min_features=min_features)
    convert_to_float8_training(model, module_filter_fn=keep, config=fp8_config(Float8LinearConfig, recipe))
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not names:
        log.warning("--fp8: no linear passed the filter (inner blocks, dims multiple of 16, >= %d); nothing "
                    "runs in FP8", min_features)
    return names


def fp8_config(config_cls, recipe: str):
    """torchao's config for `recipe`, with inner dimensions padded to 16 with zeros: cuBLAS's FP8
    GEMM needs K % 16 == 0, and K is the token count in the weight gradient (grad_out^T @ x). The
    zero rows add nothing to the product; the cost is a copy of the 1-byte FP8 operands per GEMM."""
    return dataclasses.replace(config_cls.from_recipe_name(recipe), pad_inner_dim=True)


class Fp8Warmup:
    """Blends the converted linears from high precision to FP8 over `steps` steps."""

    def __init__(self, model: nn.Module, steps: int, mode: str = "blend"):
        from torchao.float8.float8_linear import Float8Linear  # optional extra loongforge[fp8]

        if steps < 0 or mode not in ("blend", "switch"):
            raise ConfigError("fp8 warm-up: steps must be >= 0 and mode blend or switch")
        self.steps, self.mode, self.start = steps, mode, None
        self.modules = [m for m in model.modules() if isinstance(m, Float8Linear)]
        self.mix = None
        if steps:
            for m in self.modules:
                _blend_forward(m)

    def fraction(self, step: int) -> float:
        """FP8 share of the linears' output at `step` (0 = high precision, 1 = FP8)."""
        if self.start is None:
            self.start = step
        done = step - self.start
        if self.steps == 0 or done >= self.steps:
            return 1.0
        return 0.0 if self.mode == "switch" else done / self.steps

    def on_step(self, step: int) -> float:
        a = self.fraction(step)
        if a == self.mix:
            return a
        for m in self.modules:
            if a >= 1.0:
                _unblend(m)
            else:
                set_mix(m, a)
        if a >= 1.0 and self.mix is not None and self.mix < 1.0:
            log.info("fp8 warm-up done at step %d: %d linears now run in FP8 only", step, len(self.modules))
        self.mix = a
        return a


def _blend_forward(mod: nn.Module) -> None:
    """The blended forward. The share is a 0-dim tensor updated in place, not a Python float: the
    blocks are compiled with dynamic=False (fusion.py), where a float read inside the graph is a
    constant and every warm-up step would recompile every block. Only the on/off flag is Python
    (it flips once, one more graph)."""
    fp8_forward = mod.forward
    mod.__dict__[_MIX] = torch.zeros((), device=mod.weight.device)
    mod.__dict__[_MIX_ON] = False

    def forward(x: torch.Tensor) -> torch.Tensor:
        hp = F.linear(x, mod.weight, mod.bias)  # autocast, if on, applies to this call as to nn.Linear
        if not mod.__dict__[_MIX_ON]:
            return hp
        return hp + mod.__dict__[_MIX].to(hp.dtype) * (fp8_forward(x).to(hp.dtype) - hp)

    mod.__dict__["forward"] = forward


def set_mix(mod: nn.Module, a: float) -> None:
    """Set a blended linear's FP8 share in place (on the weight's device, where the model now is)."""
    mix = mod.__dict__[_MIX]
    if mix.device != mod.weight.device:
        mix = mod.__dict__[_MIX] = mix.to(mod.weight.device)
    mix.fill_(a)
    mod.__dict__[_MIX_ON] = a > 0.0


def _unblend(mod: nn.Module) -> None:
    mod.__dict__.pop(_MIX, None)
    mod.__dict__.pop(_MIX_ON, None)
    mod.__dict__.pop("forward", None)
