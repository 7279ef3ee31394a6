"""NV12 <-> RGB, the numpy reference (the trainer's device path must match it).

NV12 frame = Y plane (h, w) then interleaved CbCr plane (h/2, w), stored as
one uint8 array (3h/2, w). Matrix (BT.601/BT.709) and range (limited/full)
come from the index; chroma is upsampled by sample repetition (2x2).
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import FormatError

_KR_KB = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}


def coefficients(matrix: str, color_range: str) -> dict[str, float]:
    """Scalars of the YCbCr -> RGB transform: rgb = A @ [(Y-y0)*ys, (Cb-128)*cs, (Cr-128)*cs]."""
    try:
        kr, kb = _KR_KB[matrix]
    except KeyError:
        raise FormatError(f"unknown colour matrix {matrix!r}; expected one of {sorted(_KR_KB)}") from None
    if color_range == "limited":
        y0, ys, cs = 16.0, 255.0 / 219.0, 255.0 / 224.0
    elif color_range == "full":
        y0, ys, cs = 0.0, 1.0, 1.0
    else:
        raise FormatError(f"unknown colour range {color_range!r}; expected 'limited' or 'full'")
    kg = 1.0 - kr - kb
    return {
        "y0": y0, "ys": ys, "cs": cs,
        "r_cr": 2.0 * (1.0 - kr),
        "g_cb": -2.0 * (1.0 - kb) * kb / kg,
        "g_cr": -2.0 * (1.0 - kr) * kr / kg,
        "b_cb": 2.0 * (1.0 - kb),
        "kr": kr, "kb": kb,
    }


def split_planes(nv12: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(..., 3h/2, w) -> Y (..., h, w), U (..., h/2, w/2), V (..., h/2, w/2); views."""
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {nv12.shape}")
    y = nv12[..., :h, :]
    uv = nv12[..., h:, :]
    return y, uv[..., 0::2], uv[..., 1::2]


def nv12_to_rgb(nv12: np.ndarray, matrix: str = "bt601", color_range: str = "limited") -> np.ndarray:
    """(..., 3h/2, w) uint8 NV12 -> (..., h, w, 3) uint8 RGB."""
    c = coefficients(matrix, color_range)
    y, u, v = split_planes(nv12)
    yf = (y.astype(np.float32) - c["y0"]) * c["ys"]
    cb = (u.astype(np.float32) - 128.0) * c["cs"]
    cr = (v.astype(np.float32) - 128.0) * c["cs"]
    cb = cb.repeat(2, axis=-2).repeat(2, axis=-1)
    cr = cr.repeat(2, axis=-2).repeat(2, axis=-1)
    rgb = np.stack(
        (yf + c["r_cr"] * cr, yf + c["g_cb"] * cb + c["g_cr"] * cr, yf + c["b_cb"] * cb), axis=-1
    )
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def rgb_to_nv12(rgb: np.ndarray, matrix: str = "bt601", color_range: str = "limited") -> np.ndarray:
    """(..., h, w, 3) uint8 RGB -> (..., 3h/2, w) uint8 NV12 (chroma: 2x2 mean)."""
    c = coefficients(matrix, color_range)
    h, w = rgb.shape[-3:-1]
    if h % 2 or w % 2:
        raise FormatError(f"NV12 needs even height and width, got {h}x{w}")
    f = rgb.astype(np.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    kr, kb = c["kr"], c["kb"]
    yl = kr * r + (1 - kr - kb) * g + kb * b
    pb = (b - yl) / (2 * (1 - kb))
    pr = (r - yl) / (2 * (1 - kr))
    y = yl / c["ys"] + c["y0"]
    pb = pb.reshape(*pb.shape[:-2], h // 2, 2, w // 2, 2).mean(axis=(-3, -1))
    pr = pr.reshape(*pr.shape[:-2], h // 2, 2, w // 2, 2).mean(axis=(-3, -1))
    cb, cr = pb / c["cs"] + 128.0, pr / c["cs"] + 128.0
    uv = np.stack((cb, cr), axis=-1).reshape(*cb.shape[:-1], w)
    out = np.concatenate((y, uv), axis=-2)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
