"""NV12 -> RGB and normalization on the training device (torch).

`nv12_to_rgb` (uint8) has the same formula, float32 operation order and
rounding as the numpy reference `loongforge.shared.color.nv12_to_rgb`: it is
bit-identical. `nv12_to_input` (the model input, every frame of every batch on
the loader's hot path) is the fused form of the same transform: within 1 LSB of
the reference RGB, equal on all but ~1e-6 of inputs (see its docstring). Host
and device run the same function, so a model sees the same pixels either way.
The coefficients come from the index (matrix and range), never assumed.

Chroma is widened along rows to half resolution (w/2 -> w) and broadcast over
the two luma rows of each pair, so every broadcast runs along whole contiguous
rows. (Broadcasting quarter-resolution chroma over 2x2 blocks directly is
1.7-2.1x slower on CPU: its innermost dimension is 2, which does not vectorize.)
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

import torch

from loongforge.shared.color import coefficients
from loongforge.shared.errors import FormatError

# Pixels per CPU chunk: a chunk's float planes (~20 B/pixel with temporaries) stay in a 2-4 MiB L2.
CHUNK_PX = 1 << 17


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
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) model input: the reference RGB, /255, then (x-mean)/std.

    Fused form of `nv12_to_input_reference`, within 1 LSB of it (exactly equal
    on all but ~1e-6 of (Y, Cb, Cr) triples, those within float rounding of a
    .5 tie; tests/train/test_colorspace.py checks all 2^24). Per chunk:
    - chroma is duplicated horizontally in the integer domain: an int16 view of
      the interleaved CbCr row holds Cb | Cr<<8, and (x & 0xFF) * 257 written
      back as bytes is Cb Cb (resp. Cr Cr), 5 cheap int16 ops instead of
      repeat_interleave on floats (~6x slower per element);
    - the Y offset and the chroma scale/offset fold into one term per channel
      (k + a*C), added to ys*Y broadcast over each pair of luma rows;
    - clamp + round + normalize run once over the three planes.
    On CPU frames are processed in chunks of ~CHUNK_PX pixels, so every
    intermediate stays in L2 instead of making ~15 passes over a batch-sized
    buffer in DRAM (the reference's main cost).
    """
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {tuple(nv12.shape)}")
    if sys.byteorder != "little" or nv12.dtype != torch.uint8:
        return nv12_to_input_reference(nv12, matrix, color_range, mean=mean, std=std, dtype=dtype)
    lead, h2 = nv12.shape[:-2], h // 2
    frames = nv12.reshape(-1, rows, w)
    n = frames.shape[0]
    out = torch.empty(n, 3, h2, 2, w, dtype=torch.float32, device=nv12.device)
    k = _folded(matrix, color_range, mean, std)
    step = n if nv12.device.type != "cpu" else max(1, CHUNK_PX // (h * w))
    for s in range(0, n, step):
        _convert_chunk(frames[s:s + step], out[s:s + step], h, k)
    out = out.view(*lead, 3, h, w)
    return out if dtype == torch.float32 else out.to(dtype)


def _convert_chunk(f: torch.Tensor, o: torch.Tensor, h: int, k: dict) -> None:
    m, w = f.shape[0], f.shape[-1]
    p = f[:, h:, :].view(torch.int16)  # (m, h/2, w/2): Cb | Cr << 8 (little-endian)
    cb = (p & 0xFF).mul_(257).view(torch.uint8).float().unsqueeze_(2)  # (m, h/2, 1, w): Cb Cb ...
    cr = (p >> 8).bitwise_and_(0xFF).mul_(257).view(torch.uint8).float().unsqueeze_(2)
    y = f[:, :h, :].float().view(m, h // 2, 2, w)
    ys = k["ys"]
    torch.add(torch.add(k["kr"], cr, alpha=k["r_cr"]), y, alpha=ys, out=o[:, 0])
    g = torch.add(k["kg"], cb, alpha=k["g_cb"]).add_(cr, alpha=k["g_cr"])
    torch.add(g, y, alpha=ys, out=o[:, 1])
    torch.add(torch.add(k["kb"], cb, alpha=k["b_cb"]), y, alpha=ys, out=o[:, 2])
    o.clamp_(0.0, 255.0).round_()
    torch.add(k["shift"], o, alpha=k["scale"], out=o)  # (x - 255*mean) / (255*std) in one pass


@functools.lru_cache(maxsize=64)
def _folded(matrix: str, color_range: str, mean: float, std: float) -> dict:
    """The transform with every constant folded: channel = k + a*C + ys*Y.
    The additive constants are 0-dim tensors: torch.add(tensor, x, alpha=...)
    is one fused pass, where a Python scalar would need two."""
    c = coefficients(matrix, color_range)
    cs, k0 = c["cs"], -c["y0"] * c["ys"]
    scale = 1.0 / (255.0 * std)
    return {
        "ys": c["ys"], "r_cr": cs * c["r_cr"], "g_cb": cs * c["g_cb"], "g_cr": cs * c["g_cr"],
        "b_cb": cs * c["b_cb"], "scale": scale,
        "kr": torch.tensor(k0 - 128.0 * cs * c["r_cr"]),
        "kg": torch.tensor(k0 - 128.0 * cs * (c["g_cb"] + c["g_cr"])),
        "kb": torch.tensor(k0 - 128.0 * cs * c["b_cb"]),
        "shift": torch.tensor(-255.0 * mean * scale),
    }


def nv12_to_input_reference(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The unfused conversion, bit-identical RGB to shared.color (then /255, (x-mean)/std as one
    in-place x - 255*mean, * 1/(255*std)). Kept as the equivalence reference and the bench's 'old' row."""
    rgb = _rgb_planar(nv12, matrix, color_range)
    return rgb.sub_(mean * 255.0).mul_(1.0 / (255.0 * std)).to(dtype)


def serial_cpu_ops_in_this_thread() -> bool:
    """Make torch's CPU ops run serially in the calling thread only; True if they now do.

    The loader's prefetch thread converts frames while decode workers and the
    model's thread hold the other cores. With torch's intra-op pool every op of
    that thread is an OpenMP parallel region whose barrier waits for a pool
    thread that is often not scheduled: measured on a busy 2-core machine, a
    2-worker ShardLoader with RGB out ran at 5.3 samples/s (unfused) / 0.8
    (fused) with 2 intra-op threads and 24 / 20 serial. `torch.set_num_threads`
    cannot fix it from this thread: it is process-wide (MKL included, so the
    model's GEMMs would lose their threads). OpenMP's own `omp_set_num_threads`
    sets the calling thread's ICV only, which is what torch's parallel_for reads.
    """
    torch.get_num_threads()  # torch's lazy per-thread init first: it would overwrite the ICV set below
    lib = _openmp()
    if lib is None:
        return torch.get_num_threads() == 1
    lib.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


@functools.lru_cache(maxsize=1)
def _openmp():
    """The OpenMP runtime torch itself loaded (pip wheels ship lib/libgomp; conda builds may use libiomp5)."""
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(libdir, "libgomp*")) + glob.glob(os.path.join(libdir, "libiomp*"))):
        try:
            return ctypes.CDLL(path)  # already loaded by torch: the same instance, not a second runtime
        except OSError:
            continue
    try:
        lib = ctypes.CDLL(None)  # a system OpenMP torch linked against
        lib.omp_set_num_threads  # noqa: B018 - raises AttributeError if absent
        return lib
    except (OSError, AttributeError):
        return None
