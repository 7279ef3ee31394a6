"""NV12 -> normalized float model input on CPU in one compiled pass (numba).

The torch form of this conversion (`colorspace.nv12_to_input_ops`) is
bound by per-op dispatch and by 4 passes over the 12 B/pixel float output; one
loop that reads each input byte once and writes each output float once is
~9-11x the unfused reference (benchmarks/README.md, "The conversion") and needs
no torch.compile (30-45 s of compile: rejected). This loop
does the reference's float32 arithmetic in the reference's order, so its
output is bit-identical to `colorspace.nv12_to_input_reference` (and its RGB
to `shared.color.nv12_to_rgb`), not only within 1 LSB:
  yf = (Y - y0) * ys;  cb = (Cb - 128) * cs;  cr = (Cr - 128) * cs
  r = yf + r_cr*cr;  g = (yf + g_cb*cb) + g_cr*cr;  b = yf + b_cb*cb
  x = clip(rint(c), 0, 255);  out = (x - 255*mean) * (1 / (255*std))
every step rounded to float32 (fastmath=False: no FMA contraction, no reassociation).

numba is optional: `available()` is False without it (or when it fails to
compile), and the caller keeps the torch path. Compiling takes seconds, so the
loader calls `warm_up()` once at start; `cache=True` keeps the machine code on
disk (next to this file, else NUMBA_CACHE_DIR or the user cache dir), and a
read-only install with no writable cache dir compiles in memory instead.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import numpy as np

from loongforge.shared.color import coefficients

log = logging.getLogger(__name__)
_lock = threading.Lock()


def _convert(frames, out, k):
    """frames (n, 3h/2, w) uint8, out (n, 3, h, w) float32, k: float32 constants (see `constants`)."""
    n, rows, w = frames.shape
    h = rows * 2 // 3
    y0, ys, cs, c128 = k[0], k[1], k[2], k[3]
    r_cr, g_cb, g_cr, b_cb = k[4], k[5], k[6], k[7]
    shift, scale, lo, hi = k[8], k[9], k[10], k[11]
    # Chroma terms of one CbCr row, each sample written twice: the luma loops below then read
    # every array at unit stride and vectorize (w floats each: stays in L1).
    rt, gbt, grt, bt = (np.empty(w, np.float32), np.empty(w, np.float32),
                        np.empty(w, np.float32), np.empty(w, np.float32))
    for f in range(n):
        for i in range(h // 2):
            uv = frames[f, h + i]
            for j in range(w // 2):
                cb = (np.float32(uv[2 * j]) - c128) * cs
                cr = (np.float32(uv[2 * j + 1]) - c128) * cs
                a, b, c, d = r_cr * cr, g_cb * cb, g_cr * cr, b_cb * cb
                rt[2 * j], rt[2 * j + 1] = a, a
                gbt[2 * j], gbt[2 * j + 1] = b, b
                grt[2 * j], grt[2 * j + 1] = c, c
                bt[2 * j], bt[2 * j + 1] = d, d
            for row in range(2 * i, 2 * i + 2):
                yrow, ro, go, bo = frames[f, row], out[f, 0, row], out[f, 1, row], out[f, 2, row]
                for x in range(w):
                    yf = (np.float32(yrow[x]) - y0) * ys
                    ro[x] = (min(max(np.rint(yf + rt[x]), lo), hi) - shift) * scale
                    go[x] = (min(max(np.rint((yf + gbt[x]) + grt[x]), lo), hi) - shift) * scale
                    bo[x] = (min(max(np.rint(yf + bt[x]), lo), hi) - shift) * scale


@functools.lru_cache(maxsize=64)
def constants(matrix: str, color_range: str, mean: float, std: float) -> np.ndarray:
    """The kernel's float32 constants, each rounded to float32 as numpy/torch round a Python float
    operand of a float32 array (NEP 50 / torch's scalar wrapping)."""
    c = coefficients(matrix, color_range)
    k = np.array([c["y0"], c["ys"], c["cs"], 128.0, c["r_cr"], c["g_cb"], c["g_cr"], c["b_cb"],
                  mean * 255.0, 1.0 / (255.0 * std), 0.0, 255.0], dtype=np.float32)
    k.setflags(write=False)
    return k


@functools.lru_cache(maxsize=1)
def _kernel():
    """The compiled dispatcher, or None without numba. Decorating does not compile (that is lazy,
    on the first call or `warm_up`); it only picks the on-disk cache location."""
    try:
        import numba
    except ImportError:
        log.info("numba is not installed: NV12 conversion on CPU uses the torch ops (~3x slower)")
        return None
    opts = dict(nogil=True, fastmath=False, boundscheck=False, error_model="numpy")
    try:
        return numba.njit(cache=True, **opts)(_convert)
    except RuntimeError as exc:  # "cannot cache function ...: no locator available" (read-only install)
        log.warning("numba cannot cache the NV12 kernel (%s); it compiles in memory at every start. "
                    "Set NUMBA_CACHE_DIR to a writable directory to keep it.", exc)
        return numba.njit(cache=False, **opts)(_convert)


@functools.lru_cache(maxsize=1)
def warm_up() -> float | None:
    """Compile (or load from the disk cache) the kernel once; seconds it took, None if unavailable.
    The loader calls it at start so that no batch pays the compile."""
    kern = _kernel()
    if kern is None:
        return None
    t0 = time.perf_counter()
    try:
        with _lock:  # two threads' first calls would compile twice
            kern(np.zeros((1, 3, 2), np.uint8), np.empty((1, 3, 2, 2), np.float32),
                 constants("bt601", "limited", 0.5, 0.25))
    except Exception as exc:  # noqa: BLE001 - a numba/LLVM failure must not stop training: torch path
        log.warning("numba failed to compile the NV12 kernel (%s: %s); using the torch ops",
                    type(exc).__name__, exc)
        return None
    took = time.perf_counter() - t0
    log.debug("NV12 kernel ready in %.2f s", took)
    return took


def available() -> bool:
    return warm_up() is not None


def convert(frames: np.ndarray, out: np.ndarray, matrix: str, color_range: str, *, mean: float,
            std: float) -> None:
    """frames: C-contiguous (n, 3h/2, w) uint8 (any alignment); out: C-contiguous (n, 3, h, w) float32.
    Releases the GIL: the prefetch thread converts while the training thread runs Python."""
    _kernel()(frames, out, constants(matrix, color_range, float(mean), float(std)))
