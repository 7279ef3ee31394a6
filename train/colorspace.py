"""NV12 -> RGB and normalization on the training device (torch).

Same formula, same float32 operation order, same rounding as the numpy
reference `loongforge.shared.color.nv12_to_rgb`, so a model sees identical
pixels whether frames were converted on the host or the device. The
coefficients come from the index (matrix and range), never assumed.
"""

from __future__ import annotations

import torch

from loongforge.shared.color import coefficients
from loongforge.shared.errors import FormatError


def _planes(nv12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {tuple(nv12.shape)}")
    uv = nv12[..., h:, :]
    return nv12[..., :h, :], uv[..., 0::2], uv[..., 1::2], h, w


def _rgb_float(nv12: torch.Tensor, matrix: str, color_range: str) -> tuple[torch.Tensor, ...]:
    """R, G, B float planes (..., h, w), rounded and clamped exactly like the reference."""
    c = coefficients(matrix, color_range)
    y, u, v, h, w = _planes(nv12)
    h2, w2 = h // 2, w // 2
    # Chroma stays at quarter resolution and is broadcast over each 2x2 luma block: the same
    # per-pixel values as the reference's sample repetition, without materializing them.
    yf = ((y.to(torch.float32) - c["y0"]) * c["ys"]).unflatten(-2, (h2, 2)).unflatten(-1, (w2, 2))
    cb = ((u.to(torch.float32) - 128.0) * c["cs"])[..., :, None, :, None]
    cr = ((v.to(torch.float32) - 128.0) * c["cs"])[..., :, None, :, None]
    r = yf + c["r_cr"] * cr
    g = yf + c["g_cb"] * cb + c["g_cr"] * cr
    b = yf + c["b_cb"] * cb
    # torch.round and np.rint both round half to even.
    return tuple(x.round_().clamp_(0.0, 255.0).flatten(-4, -3).flatten(-2, -1) for x in (r, g, b))


def nv12_to_rgb(nv12: torch.Tensor, matrix: str = "bt601", color_range: str = "limited") -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., h, w, 3) uint8; equals shared.color.nv12_to_rgb."""
    return torch.stack(_rgb_float(nv12, matrix, color_range), dim=-1).to(torch.uint8)


def nv12_to_input(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) model input: the reference RGB, /255, then (x-mean)/std."""
    rgb = torch.stack(_rgb_float(nv12, matrix, color_range), dim=-3)
    # One fused multiply-add: x/255/std - mean/std (differs from the two-step form by float rounding only).
    return torch.add(rgb, -mean * 255.0, alpha=1.0).mul_(1.0 / (255.0 * std)).to(dtype)
