"""NV12 -> RGB and normalization on the training device (torch).

`nv12_to_rgb` (uint8) has the same formula, float32 operation order and
rounding as the numpy reference `loongforge.shared.color.nv12_to_rgb`: it is
bit-identical. `nv12_to_input` (the model input, every frame of every batch on
the loader's hot path) is the same transform fused: on CPU one compiled pass
(colorspace_jit, numba), bit-identical; on CUDA (and on CPU without numba) the
fused torch ops of `nv12_to_input_ops`, within 1 LSB of the reference RGB and
equal on all but ~1e-6 of inputs. Either way a model sees the same pixels to 1 LSB.
The coefficients come from the index (matrix and range), never assumed.

Chroma is widened along rows to half resolution (w/2 -> w) and broadcast over
the two luma rows of each pair, so every broadcast runs along whole contiguous
rows. (Broadcasting quarter-resolution chroma over 2x2 blocks directly is
1.7-2.1x slower on CPU: its innermost dimension is 2, which does not vectorize;
so is a strided uint8 -> float copy of the interleaved CbCr plane.)
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
from loongforge.train.data import colorspace_jit

# Pixels per CPU chunk (4 frames of 256x256): the chroma and luma ops' dispatch is amortized over the chunk.
CHUNK_PX = 1 << 18
# Pixels per output pass on CPU (1 frame of 256x256): the 4 passes over the 12 B/pixel float output
# run on a slice that stays in a 2 MiB L2 between passes (a whole chunk would go to L3 each pass).
# Measured interleaved at load ~20 on 2 cores: 1.68x the reference with these two, 1.54x with the
# output passes over the whole chunk, 1.45x with 2-frame chunks, 1.59x with 8.
OUT_PX = 1 << 16


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
                  dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """(..., 3h/2, w) uint8 -> (..., 3, h, w) model input: the reference RGB, /255, then (x-mean)/std.

    On CPU (uint8, numba installed): one compiled pass, bit-identical to
    `nv12_to_input_reference` (train/data/colorspace_jit.py). Elsewhere (CUDA, no
    numba): `nv12_to_input_ops`, within 1 LSB of it. `out` (float32, contiguous, as many
    elements as the result) receives the result when given: a recycled buffer saves
    the page faults of a fresh 12 B/pixel allocation per batch.
    """
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {tuple(nv12.shape)}")
    if out is not None and (out.dtype != torch.float32 or dtype != torch.float32 or not out.is_contiguous()
                            or out.numel() != nv12.numel() * 2):
        raise ValueError(f"out must be a contiguous float32 tensor of {nv12.numel() * 2} elements")
    if nv12.device.type == "cpu" and nv12.dtype == torch.uint8 and colorspace_jit.available():
        return _input_jit(nv12, matrix, color_range, mean=mean, std=std, dtype=dtype, out=out)
    res = nv12_to_input_ops(nv12, matrix, color_range, mean=mean, std=std, dtype=dtype)
    return res if out is None else out.view(res.shape).copy_(res)


def nv12_to_input_ops(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`nv12_to_input` as fused torch ops: the CUDA path, and the CPU one without numba.

    Fused form of `nv12_to_input_reference`, within 1 LSB of it (exactly equal
    on all but ~1e-6 of (Y, Cb, Cr) triples, those within float rounding of a
    .5 tie; tests/train/data/test_colorspace.py checks all 2^24). Per chunk of
    CHUNK_PX pixels, 10 ops, then 4 per OUT_PX slice of the output (on CPU each
    op costs ~5-20 us of dispatch here, as much as its arithmetic on a frame):
    - chroma is split and duplicated horizontally in the integer domain: an
      int32 view of the interleaved CbCr row holds Cb0 Cr0 Cb1 Cr1, and
      (q & 0x00FF00FF) * 257 is Cb0 Cb0 Cb1 Cb1 as bytes (Cr: shift by 8 first),
      4 cheap ops on quarter-resolution words, then one uint8 -> float copy;
    - the Y offset and the chroma scale/offset fold into one term per channel
      (k + a*C), written for the three channels into one buffer, and a single
      broadcast add writes the whole chunk: t (3, h/2, 1, w) + ys*Y (1, h/2, 2, w);
    - that add, clamp + round and normalize run over one L2-sized slice of the
      output at a time (the floor of this design: 4 full-resolution float
      passes, see benchmarks/README.md).
    Scratch buffers are allocated once per call and reused by every chunk.
    """
    rows, w = nv12.shape[-2:]
    h = rows * 2 // 3
    if rows * 2 % 3 or h % 2 or w % 2:
        raise FormatError(f"not an NV12 frame shape: {tuple(nv12.shape)}")
    if sys.byteorder != "little" or nv12.dtype != torch.uint8 or w % 4:
        return nv12_to_input_reference(nv12, matrix, color_range, mean=mean, std=std, dtype=dtype)
    lead, h2 = nv12.shape[:-2], h // 2
    frames = nv12.reshape(-1, rows, w)
    # The int32 view of the CbCr rows needs unit-stride rows and 4-byte alignment: a column-major
    # array, or a slice of a byte buffer at an odd offset, is copied once first.
    if not frames.is_contiguous():
        frames = frames.contiguous()
    elif frames.storage_offset() % 4:
        frames = frames.clone()
    n = frames.shape[0]
    out = torch.empty(n, 3, h2, 2, w, dtype=torch.float32, device=nv12.device)
    k = _folded(matrix, color_range, mean, std)
    step = n if nv12.device.type != "cpu" else max(1, min(n, CHUNK_PX // (h * w)))
    ws = _Scratch(step, h2, w, nv12.device)
    for s in range(0, n, step):
        m = min(step, n - s)
        _convert_chunk(frames[s:s + m], out[s:s + m], h, k, ws if m == step else _Scratch(m, h2, w, nv12.device))
    out = out.view(*lead, 3, h, w)
    return out if dtype == torch.float32 else out.to(dtype)


def _input_jit(nv12: torch.Tensor, matrix: str, color_range: str, *, mean: float, std: float,
               dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: one compiled pass (colorspace_jit), bit-identical to the reference. Any
    strided view is copied once to contiguous bytes first (1.5 B/pixel, against 12 B/pixel out)."""
    rows, w = nv12.shape[-2:]
    frames = nv12.reshape(-1, rows, w).contiguous()
    shape = (frames.shape[0], 3, rows * 2 // 3, w)
    out = torch.empty(shape, dtype=torch.float32) if out is None else out.view(shape)
    colorspace_jit.convert(frames.numpy(), out.numpy(), matrix, color_range, mean=mean, std=std)
    out = out.view(*nv12.shape[:-2], 3, rows * 2 // 3, w)
    return out if dtype == torch.float32 else out.to(dtype)


class _Scratch:
    """One chunk's intermediates: packed chroma words, chroma floats, channel terms, Y floats."""

    def __init__(self, m: int, h2: int, w: int, device: torch.device):
        self.words = torch.empty(m, 2, h2, w // 4, dtype=torch.int32, device=device)
        self.chroma = torch.empty(m, 2, h2, w, dtype=torch.float32, device=device)
        self.terms = torch.empty(m, 3, h2, 1, w, dtype=torch.float32, device=device)
        self.luma = torch.empty(m, 1, h2, 2, w, dtype=torch.float32, device=device)


_LOW_BYTES = 0x00FF00FF  # bytes 0 and 2 of a little-endian int32: Cb0, Cb1 (after >> 8: Cr0, Cr1)


def _convert_chunk(f: torch.Tensor, o: torch.Tensor, h: int, k: dict, ws: _Scratch) -> None:
    q = f[:, h:, :].view(torch.int32)  # (m, h/2, w/4): bytes Cb0 Cr0 Cb1 Cr1 (little-endian)
    words = ws.words
    torch.bitwise_and(q, _LOW_BYTES, out=words[:, 0])
    # Arithmetic shift: Cr1's sign bits land in byte 3, which the mask clears.
    torch.bitwise_right_shift(q, 8, out=words[:, 1]).bitwise_and_(_LOW_BYTES)
    words.mul_(257)  # 0x00BB00AA * 257 = bytes AA AA BB BB: each chroma sample twice, no overflow
    c = ws.chroma
    c.copy_(words.view(torch.uint8).view(c.shape))
    cb, cr, t = c[:, 0], c[:, 1], ws.terms
    torch.add(k["kr"], cr, alpha=k["r_cr"], out=t[:, 0, :, 0])
    torch.add(k["kg"], cb, alpha=k["g_cb"], out=t[:, 1, :, 0]).add_(cr, alpha=k["g_cr"])
    torch.add(k["kb"], cb, alpha=k["b_cb"], out=t[:, 2, :, 0])
    y = ws.luma
    y.copy_(f[:, :h, :].view(y.shape))
    m = f.shape[0]
    step = m if f.device.type != "cpu" else max(1, OUT_PX // (h * f.shape[-1]))
    for j in range(0, m, step):
        oj = o[j:j + step]
        # (., 3, h/2, 1, w) + ys * (., 1, h/2, 2, w): every pixel of the slice, all three channels
        torch.add(t[j:j + step], y[j:j + step], alpha=k["ys"], out=oj)
        oj.clamp_(0.0, 255.0).round_()
        torch.add(k["shift"], oj, alpha=k["scale"], out=oj)  # (x - 255*mean) / (255*std) in one pass


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
