"""NV12 -> RGB and normalization on the training device (torch).

Same formula, same float32 operation order, same rounding as the numpy
reference `loongforge.shared.color.nv12_to_rgb`, so a model sees identical
pixels whether frames were converted on the host or the device. The
coefficients come from the index (matrix and range), never assumed.

Hot path (every frame of every batch): one output allocation and in-place
arithmetic. Chroma is repeated along rows to half resolution (w/2 -> w) and
broadcast over the two luma rows of each pair, so every broadcast runs along
whole contiguous rows. (Broadcasting quarter-resolution chroma over 2x2
blocks directly is 1.7-2.1x slower on CPU: its innermost dimension is 2,
which does not vectorize.)
"""

from __future__ import annotations

import torch

from loongforge.shared.color import coefficients
from loongforge.shared.errors import FormatError


def _rgb_planar(nv12: torch.Tensor, matrix: str, color_range: str) -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) float32 holding the reference's rounded, clamped RGB."""
    c = coefficients(matrix, color_range)
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {tuple(nv12.shape)}")
    lead, h2 = nv12.shape[:-2], h // 2
    uv = nv12[..., h:, :]
    yf = nv12[..., :h, :].to(torch.float32).sub_(c["y0"]).mul_(c["ys"]).view(*lead, h2, 2, w)
    cb = uv[..., 0::2].to(torch.float32).sub_(128.0).mul_(c["cs"]).repeat_interleave(2, dim=-1)[..., :, None, :]
    cr = uv[..., 1::2].to(torch.float32).sub_(128.0).mul_(c["cs"]).repeat_interleave(2, dim=-1)[..., :, None, :]
    out = torch.empty(*lead, 3, h2, 2, w, dtype=torch.float32, device=nv12.device)
    # Same association as the reference: g = (y + g_cb*cb) + g_cr*cr, so results are bit-identical.
    torch.add(yf, cr * c["r_cr"], out=out[..., 0, :, :, :])
    torch.add(yf, cb * c["g_cb"], out=out[..., 1, :, :, :]).add_(cr * c["g_cr"])
    torch.add(yf, cb * c["b_cb"], out=out[..., 2, :, :, :])
    # torch.round and np.rint both round half to even.
    return out.round_().clamp_(0.0, 255.0).view(*lead, 3, h, w)


def nv12_to_rgb(nv12: torch.Tensor, matrix: str = "bt601", color_range: str = "limited") -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., h, w, 3) uint8; equals shared.color.nv12_to_rgb."""
    return _rgb_planar(nv12, matrix, color_range).movedim(-3, -1).to(torch.uint8)


def nv12_to_input(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) model input: the reference RGB, /255, then (x-mean)/std
    (as one in-place x - 255*mean, * 1/(255*std): equal up to float rounding)."""
    rgb = _rgb_planar(nv12, matrix, color_range)
    return rgb.sub_(mean * 255.0).mul_(1.0 / (255.0 * std)).to(dtype)
