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
    c = coefficients(matrix, color_range)
    y, u, v, _, _ = _planes(nv12)
    yf = (y.to(torch.float32) - c["y0"]) * c["ys"]
    cb = (u.to(torch.float32) - 128.0) * c["cs"]
    cr = (v.to(torch.float32) - 128.0) * c["cs"]
    # 2x2 sample repetition = the reference's chroma upsampling.
    cb = cb.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)
    cr = cr.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)
    r = yf + c["r_cr"] * cr
    g = yf + c["g_cb"] * cb + c["g_cr"] * cr
    b = yf + c["b_cb"] * cb
    # torch.round and np.rint both round half to even.
    return tuple(torch.clamp(torch.round(x), 0.0, 255.0) for x in (r, g, b))


def nv12_to_rgb(nv12: torch.Tensor, matrix: str = "bt601", color_range: str = "limited") -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., h, w, 3) uint8; equals shared.color.nv12_to_rgb."""
    return torch.stack(_rgb_float(nv12, matrix, color_range), dim=-1).to(torch.uint8)


def nv12_to_input(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) model input: the reference RGB, /255, then (x-mean)/std."""
    rgb = torch.stack(_rgb_float(nv12, matrix, color_range), dim=-3)
    return ((rgb * (1.0 / 255.0) - mean) * (1.0 / std)).to(dtype)
