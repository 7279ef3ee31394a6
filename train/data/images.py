"""N1.6's image transform, exactly as Isaac-GR00T builds it, in two paths that share one geometry.

Isaac-GR00T (albumentations on uint8 frames, then Eagle's processor) turns a decoded RGB frame into
the model's pixels in these steps (`plan`: the one definition both paths read):

    LetterBoxPad (black; top/left get pad // 2)  ->  cv2.resize to edge x edge, INTER_AREA  ->
    crop `crop` x `crop` at (x0, y0): centred at evaluation, each in 0 .. edge - crop in training  ->
    cv2.resize to edge, INTER_AREA  ->  [training: ColorJitter]  ->  PIL resize to Eagle's size
    (smart_resize: a multiple of 28; PIL's default filter, bicubic)  ->  (u8 - 127.5) / 127.5

* The reference path (`reference_augment`, `reference_pixels`) runs these steps with the real
  libraries on uint8, bit for bit what Isaac-GR00T produces (tests/train/data/test_images.py checks
  it against Isaac-GR00T's own outputs). CPU only: the check and the ground truth.
* The device path (`device_images`) writes each resize as the weight matrix its library defines
  (`axis_matrix`) and composes a camera's steps into one (H x h) and one (W x w) matrix per crop
  offset: two batched matmuls per batch, on float input straight from the NV12 conversion, with
  no uint8 rounding between steps (within ~2 levels of the reference, ~0.25 mean). Training
  rounds the albumentations-stage output to whole levels, as the reference's is uint8, runs the
  colour jitter (`device_jitter`: the four ops with the library's own rounding, vectorised over
  the batch), then Eagle's resize as two more matmuls.

The draws (crop offset, jitter factors and order) are a pure function of (seed, epoch, sample id):
`image_draws`. Every image of a sample (all cameras, all frames) shares its sample's draws, as
Isaac-GR00T replays the first view's parameters on the others.

`reference_rgb` turns a stored NV12 frame into the RGB Isaac-GR00T's decoder (torchcodec, FFmpeg's
swscale rgb24) returns for it, bit for bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from loongforge.shared.errors import ConfigError
from loongforge.train.data.lerobot_items import PyAVRGB


@dataclass(frozen=True, slots=True)
class Geometry:
    """N1.6's sizes (processor_config.json: shortest_image_edge 256, crop_fraction 0.95)."""

    edge: int = 256  # SmallestMaxSize before and after the crop
    crop: int = 243  # int(edge * crop_fraction)
    size: tuple[int, int] = (252, 252)  # Eagle's smart_resize of edge x edge: (H, W)

    def __post_init__(self):
        if not 0 < self.crop <= self.edge:
            raise ConfigError(f"image crop {self.crop} must be in 1..edge ({self.edge})")

    @property
    def offsets(self) -> int:
        """How many crop positions per axis (FractionalRandomCrop draws 0 .. edge - crop)."""
        return self.edge - self.crop + 1

    @property
    def centre(self) -> int:
        return (self.edge - self.crop) // 2  # FractionalCenterCrop


@dataclass(frozen=True, slots=True)
class Step:
    """One step of `plan`, by axis: rows (height) and cols (width) each hold (a, b) =
    pad: (before, after); area / bicubic: (from, to) lengths; crop: (offset, length)."""

    kind: str  # "pad" | "area" (cv2 INTER_AREA) | "crop" | "bicubic" (PIL's default resize)
    rows: tuple[int, int]
    cols: tuple[int, int]


def plan(h: int, w: int, geo: Geometry, x0: int | None = None, y0: int | None = None) -> list[Step]:
    """The steps that turn an h x w frame into the model's pixels; the last step (Eagle's resize)
    follows the albumentations output, where the colour jitter applies. None: centred crop."""
    side, e, c = max(h, w), geo.edge, geo.crop
    x0, y0 = geo.centre if x0 is None else x0, geo.centre if y0 is None else y0
    if not (0 <= x0 < geo.offsets and 0 <= y0 < geo.offsets):
        raise ValueError(f"crop offset ({x0}, {y0}) outside 0..{geo.offsets - 1}")
    ph, pw = side - h, side - w
    return [Step("pad", (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2)),
            # SmallestMaxSize of a square: edge x edge exactly (albumentations rounds side * edge / side)
            Step("area", (side, e), (side, e)),
            Step("crop", (y0, c), (x0, c)),
            Step("area", (c, e), (c, e)),
            Step("bicubic", (e, geo.size[0]), (e, geo.size[1]))]


# ---- the reference path: the real libraries on uint8 ----


@dataclass(frozen=True, slots=True)
class Jitter:
    """One sample's ColorJitter: the factors, and the order of the ops (0 brightness, 1 contrast,
    2 saturation, 3 hue), as albumentations 1.4.18 records them."""

    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0
    hue: float = 0.0
    order: tuple[int, ...] = (0, 1, 2, 3)


def reference_augment(image: np.ndarray, geo: Geometry = Geometry(), *, offset: tuple[int, int] | None = None,
                      jitter: Jitter | None = None) -> np.ndarray:
    """(h, w, 3) uint8 RGB -> (edge, edge, 3) uint8: Isaac-GR00T's albumentations transform
    (eval: offset None, no jitter; training: the crop at offset (x0, y0), then the jitter)."""
    import cv2  # the train extra; only the reference path (tests, checks) needs OpenCV

    x0, y0 = offset if offset is not None else (None, None)
    img = np.ascontiguousarray(image, dtype=np.uint8)
    for s in plan(*img.shape[:2], geo, x0, y0)[:-1]:
        if s.kind == "pad" and any(s.rows + s.cols):
            img = cv2.copyMakeBorder(img, *s.rows, *s.cols, cv2.BORDER_CONSTANT, value=0)
        elif s.kind == "area" and (s.rows[0], s.cols[0]) != (s.rows[1], s.cols[1]):
            img = cv2.resize(img, (s.cols[1], s.rows[1]), interpolation=cv2.INTER_AREA)
        elif s.kind == "crop":
            img = np.ascontiguousarray(img[s.rows[0]:sum(s.rows), s.cols[0]:sum(s.cols)])
    return img if jitter is None else reference_jitter(img, jitter)


def reference_pixels(image: np.ndarray, geo: Geometry = Geometry(), *, offset: tuple[int, int] | None = None,
                     jitter: Jitter | None = None) -> np.ndarray:
    """(h, w, 3) uint8 RGB -> (3, H, W) uint8: `reference_augment`, then Eagle's resize (PIL,
    default filter). The model's pixel values are `pixel_values` of this."""
    from PIL import Image  # the train extra; only the reference path needs Pillow

    img = reference_augment(image, geo, offset=offset, jitter=jitter)
    last = plan(*image.shape[:2], geo)[-1]
    out = Image.fromarray(img).resize((last.cols[1], last.rows[1]))  # Image.resize's default: BICUBIC
    return np.asarray(out).transpose(2, 0, 1).copy()


def pixel_values(u8: np.ndarray) -> np.ndarray:
    """uint8 -> float32 (u8 - 127.5) / 127.5: Eagle's rescale 1/255 and normalize (0.5, 0.5), which
    HF fuses into one affine step in float32 (the fixture checks the float tensors bit for bit)."""
    return (u8.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)


def reference_jitter(img: np.ndarray, j: Jitter) -> np.ndarray:
    """albumentations 1.4.18's ColorJitter on (h, w, 3) uint8, the ops in `j.order`. Each op is the
    library's uint8 arithmetic: LUTs truncate to uint8, cv2 rounds."""
    import cv2

    for op in j.order:
        if op == 0 and j.brightness != 1:  # clipped multiply, through a float32 LUT (albucore)
            lut = np.arange(256, dtype=np.float32) * np.float32(j.brightness)
            img = cv2.LUT(img, np.clip(lut, 0, 255).astype(np.uint8))
        elif op == 1 and j.contrast != 1:  # x * f + mean(gray) * (1 - f), a float32 LUT
            mean = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).mean()
            lut = np.arange(256, dtype=np.float32) * np.float32(j.contrast) + np.float32(mean * (1 - j.contrast))
            img = cv2.LUT(img, np.clip(lut, 0, 255).astype(np.uint8))
        elif op == 2 and j.saturation != 1:  # blend with the per-pixel grey, cv2 rounding
            gray = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
            img = cv2.addWeighted(img, j.saturation, gray, 1 - j.saturation, 0)
        elif op == 3 and j.hue != 0:  # cv2's 8-bit HSV (H in 0..179), H shifted by 180 * hue, truncated
            hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
            lut = np.mod(np.arange(256, dtype=np.int16) + 180 * j.hue, 180).astype(np.uint8)
            hsv[..., 0] = cv2.LUT(hsv[..., 0], lut)
            img = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
    return img


def reference_rgb(nv12: np.ndarray, matrix: str = "bt601", color_range: str = "limited") -> np.ndarray:
    """(3h/2, w) uint8 NV12 (a shard's frame) -> (h, w, 3) uint8 RGB, bit for bit what Isaac-GR00T's
    decoder returns for the frame those planes came from.

    Its decoder (torchcodec; PyAV's rgb24 equally) converts the decoded yuv420p planes with FFmpeg's
    swscale, whose fixed-point arithmetic is not the exact formula of shared/color.py (up to 3
    levels apart, ~1 level brighter on average). A shard holds the planes bit for bit, so handing
    them back to swscale as a yuv420p frame tagged with the stream's matrix and range
    (lerobot_items.PyAVRGB, PyAV: the preprocess extra) reproduces that RGB."""
    return PyAVRGB()(np.ascontiguousarray(nv12)[None], matrix, color_range)[0]


# ---- the device path: every resize as the weight matrix its library defines ----


@functools.lru_cache(maxsize=32)
def area_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) float64: cv2.resize INTER_AREA along one axis of a square image (both axes
    scale alike; OpenCV picks the mode from both). Shrinking: area averaging (resizeArea's
    table); enlarging: OpenCV's area variant of linear interpolation, whose fraction is
    (d + 1) - (s + 1) * n_out / n_in rather than the pixel-centre one. The weights are OpenCV's
    float32 ones (its float path uses them as they are; its uint8 path rounds them to 1/2048)."""
    if n_in == n_out:
        return _frozen(np.eye(n_in))
    inv = n_out / n_in
    scale = 1.0 / inv  # as OpenCV computes it: 1 / (dst / src), not src / dst
    m = np.zeros((n_out, n_in))
    for d in range(n_out):
        if scale >= 1:
            f1 = d * scale
            f2, cell = f1 + scale, min(scale, n_in - f1)
            s2 = min(math.floor(f2), n_in - 1)
            s1 = min(math.ceil(f1), s2)
            if s1 - f1 > 1e-3:
                m[d, s1 - 1] = np.float32((s1 - f1) / cell)
            m[d, s1:s2] = np.float32(1.0 / cell)
            if f2 - s2 > 1e-3:
                m[d, s2] = np.float32(min(f2 - s2, 1.0, cell) / cell)
        else:
            s = math.floor(d * scale)
            fx = np.float32((d + 1) - (s + 1) * inv)
            fx = np.float32(0) if fx <= 0 else fx - np.float32(math.floor(fx))
            if s >= n_in - 1:
                s, fx = n_in - 1, np.float32(0)
            m[d, s] += np.float32(1) - fx
            if fx:
                m[d, s + 1] += fx
    return _frozen(m)


@functools.lru_cache(maxsize=32)
def bicubic_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) float64: Pillow's BICUBIC resize along one axis (Resample.c precompute_coeffs:
    Keys' cubic, a = -0.5, its support widened by the scale when shrinking (antialias), each row
    normalized to sum 1). Pillow's uint8 path rounds these to 22-bit fixed point, and rounds to
    uint8 between its horizontal and vertical passes."""
    if n_in == n_out:
        return _frozen(np.eye(n_in))
    scale = n_in / n_out
    fscale = max(scale, 1.0)
    support = 2.0 * fscale
    m = np.zeros((n_out, n_in))
    for d in range(n_out):
        centre = (d + 0.5) * scale
        lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), n_in)
        t = np.abs((np.arange(lo, hi) - centre + 0.5) / fscale)
        k = np.where(t < 1, (1.5 * t - 2.5) * t * t + 1, np.where(t < 2, ((-0.5 * t + 2.5) * t - 4) * t + 2, 0.0))
        m[d, lo:hi] = k / k.sum() if k.sum() != 0 else k
    return _frozen(m)


def _frozen(m: np.ndarray) -> np.ndarray:
    m.flags.writeable = False  # cached and shared: a caller's write would change every later result
    return m


_STEP_MATRIX = {"area": area_weights, "bicubic": bicubic_weights}


def axis_matrix(n: int, side: int, geo: Geometry, offset: int | None = None, stage: str = "pixels") -> np.ndarray:
    """(out, n) float64: one axis of `plan` as one matrix, for an axis of n pixels of a frame whose
    longer side is `side`, with the crop at `offset` (None: centred). stage "augment" stops at the
    albumentations output (edge), "pixels" goes on through Eagle's resize."""
    steps = plan(n, side, geo, y0=offset)
    m = np.eye(n)
    for s in steps if stage == "pixels" else steps[:-1]:
        a, b = s.rows
        if s.kind == "pad":  # letterbox rows are black: zero weight, filled in by `device_images`
            m = np.concatenate([np.zeros((a, m.shape[1])), m, np.zeros((b, m.shape[1]))])
        elif s.kind == "crop":
            m = m[a:a + b]
        else:
            m = _STEP_MATRIX[s.kind](a, b) @ m
    return m


@functools.lru_cache(maxsize=64)
def _matrices(n: int, side: int, geo: Geometry, stage: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(offsets, out, n): `axis_matrix` for every crop offset, on the device, cached per camera
    size (14 x 252 x n floats: 9 MB at n = 640)."""
    m = np.stack([axis_matrix(n, side, geo, o, stage) for o in range(geo.offsets)])
    return torch.from_numpy(m).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=8)
def _eagle(geo: Geometry, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagle's resize alone (edge -> size), rows and cols: the training path's last step, after the jitter."""
    return tuple(torch.tensor(bicubic_weights(geo.edge, n), device=device, dtype=dtype) for n in geo.size)


def _resample(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, black: float) -> torch.Tensor:
    """rows @ x @ cols^T for (N, C, h, w) x with rows (out_h, h) / cols (out_w, w), shared or one
    per image ((N, out_h, h)): two (batched) matmuls, the cheaper order first. Padding rows and
    columns have zero weight, so an output pixel misses black * (1 - its weights' sum): added back
    as one rank-1 term when black is not 0."""
    if rows.dim() == 3:
        rows, cols = rows[:, None], cols[:, None]
    h, w = x.shape[-2:]
    oh, ow = rows.shape[-2], cols.shape[-2]
    if h * w * ow + oh * h * ow <= oh * h * w + oh * w * ow:
        y = rows @ (x @ cols.transpose(-1, -2))
    else:
        y = (rows @ x) @ cols.transpose(-1, -2)
    if black:
        covered = rows.sum(-1)[..., :, None] * cols.sum(-1)[..., None, :]
        y = y.add_(covered.sub_(1).mul_(-black))
    return y


def device_images(x: torch.Tensor, geo: Geometry = Geometry(), *, draws: ImageDraws | None = None,
                  offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
                  units: tuple[float, float] = (0.0, 255.0), stage: str = "pixels") -> torch.Tensor:
    """(N, 3, h, w) float RGB of one camera -> (N, 3, H, W): N1.6's transform on the device
    (stage "augment": stop at the albumentations output, (N, 3, edge, edge)).

    `units`: the values of 8-bit levels 0 and 255 in x's units ((0, 255) for 0..255 RGB,
    (-1, 1) for Eagle's normalized input); the output is in the same units, letterbox black
    included. `draws` (one row per image, `ImageDraws.per_image`): training, its crop offsets and
    colour jitter; `offsets` (x0, y0), (N,) integer tensors: a crop without jitter; neither: the
    centred crop of evaluation. Run it in float32, TF32 off (torch's default): TF32's 10-bit
    operands add up to 0.27 level (0.025 mean; emulated on the fixture's images). Nothing here
    waits for the device: the draws are the host's, and so are the jitter's per-op image lists."""
    if draws is not None and offsets is not None:
        raise ValueError("give draws (crop + jitter) or offsets (crop only), not both")
    n, h, w = x.shape[0], *x.shape[-2:]
    side, lo, hi = max(h, w), *units
    if stage not in ("augment", "pixels"):
        raise ValueError(f"stage {stage!r}: 'augment' or 'pixels'")
    jitter = draws is not None and draws.factors is not None
    first = "augment" if jitter else stage
    rows, cols = _matrices(h, side, geo, first, x.device, x.dtype), _matrices(w, side, geo, first, x.device, x.dtype)
    if draws is not None:
        if len(draws) != n:
            raise ValueError(f"{len(draws)} draws for {n} images: repeat each sample's draws per image")
        offsets = tuple(torch.from_numpy(a).to(x.device, non_blocking=True) for a in (draws.x0, draws.y0))
    if offsets is None:
        y = _resample(x, rows[geo.centre], cols[geo.centre], lo)
    else:
        y = _resample(x, rows[offsets[1].long()], cols[offsets[0].long()], lo)
    if not jitter:
        return y.clamp_(lo, hi)  # bicubic overshoots; Pillow clips to uint8
    if units != (0.0, 255.0):
        y = y.sub_(lo).mul_(255.0 / (hi - lo))
    y = y.round_().clamp_(0.0, 255.0)  # the albumentations output is uint8: the jitter's input levels
    y = device_jitter(y, draws.factors, draws.order)
    if units != (0.0, 255.0):
        y = y.mul_((hi - lo) / 255.0).add_(lo)
    if stage == "augment":
        return y
    er, ec = _eagle(geo, x.device, x.dtype)
    return _resample(y, er, ec, 0.0).clamp_(lo, hi)


# ---- colour jitter on the device, and the draws ----
#
# The four ops as albumentations runs them on uint8, written in torch on whole levels: each op's
# input is whole levels in 0..255 (the device path rounds the albumentations-stage output, as the
# reference's is uint8) and each op rounds as the library does, so on the same uint8 input the
# results agree with the reference's but for float ties (the tests measure it). Without that
# rounding, the uint8 steps the float ops skip would be 4 steps of +-0.5 noise and a bias of
# -0.5 level per truncating op.


def _gray(x: torch.Tensor) -> torch.Tensor:
    """OpenCV's RGB2GRAY on uint8: (4899 R + 9617 G + 1868 B + 2^13) >> 14, exact in float32."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    return (r * 4899).add_(g, alpha=9617).add_(b, alpha=1868).add_(8192).div_(16384).floor_()


# The ops work in place on their input (device_jitter's buffer): one temporary fewer per step.
def _brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    # albucore's LUT: float32 level * float32 factor, clipped, truncated to uint8.
    return x.mul_(f.to(x.dtype)[:, None, None, None]).clamp_(0.0, 255.0).floor_()


def _contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    # LUT level * f + mean(grey) * (1 - f), both float32, truncated; the mean is the image's own
    # (float64, as numpy's mean); the factor the sample's.
    mean = _gray(x).double().mean(dim=(-1, -2), keepdim=True)
    f64 = f.double()[:, None, None, None]
    return x.mul_(f64.to(x.dtype)).add_((mean * (1 - f64)).to(x.dtype)).clamp_(0.0, 255.0).floor_()


def _saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    # cv2.addWeighted(img, f, grey, 1 - f, 0) on uint8: float32 weights, rounded half to even.
    f64 = f.double()[:, None, None, None]
    grey = _gray(x).mul_((1 - f64).to(x.dtype))
    return x.mul_(f64.to(x.dtype)).add_(grey).round_().clamp_(0.0, 255.0)


_HSV_TABLE = ((1, 1, 3, 0, 0, 2), (3, 0, 0, 2, 1, 1), (0, 2, 1, 1, 3, 0))  # tab entry of B, G, R per sector


@functools.lru_cache(maxsize=8)
def _hsv_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenCV's 8-bit RGB -> HSV division tables, round((255 << 12) / v) and round((180 << 12) /
    (6 d)) (0 at 0), and the sector -> tab entry table of its HSV -> RGB."""
    i = np.arange(256, dtype=np.float64)
    with np.errstate(divide="ignore"):
        sdiv, hdiv = np.where(i > 0, np.rint(1044480.0 / i), 0), np.where(i > 0, np.rint(737280.0 / (6 * i)), 0)
    return (torch.tensor(sdiv, dtype=torch.int32, device=device), torch.tensor(hdiv, dtype=torch.int32, device=device),
            torch.tensor(_HSV_TABLE, dtype=torch.long, device=device))


def _hue(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """OpenCV's 8-bit RGB -> HSV (integer: H in 0..179 in 2-degree units, S rounded to 0..255),
    H moved by 180 * f through albumentations' truncating LUT (for whole H: by floor(180 f),
    modulo 180), then OpenCV's 8-bit HSV -> RGB (float32, truncated by its SIMD path)."""
    sdiv, hdiv, table = _hsv_tables(x.device)
    q = x.to(torch.int32)
    r, g, b = q.unbind(1)
    v = q.amax(1)
    diff = v - q.amin(1)
    s = (diff * sdiv[v] + 2048) >> 12
    num = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (num * hdiv[diff] + 2048) >> 12
    shift = torch.floor(180 * f.double()).to(torch.int32)[:, None, None]
    h = torch.remainder(h + shift, 180).float()  # h < 0 (+180 in OpenCV) folds in here too
    sf, vf = s.float() * (1.0 / 255.0), v.float() * (1.0 / 255.0)
    h = h * torch.tensor(6.0 / 180.0, dtype=torch.float32)
    sector = torch.floor(h)
    h = h - sector
    tab = torch.stack([vf, vf * (1 - sf), vf * (1 - sf * h), vf * (1 - sf * (1 - h))])  # (4, n, H, W)
    pick = table[:, sector.long()]  # (3, n, H, W): the tab entry of B, G, R
    rgb = tab.gather(0, pick.flip(0)).movedim(0, 1)
    return torch.trunc(torch.where(sf[:, None] > 0, rgb, vf[:, None]) * 255.0).to(x.dtype)


_OPS = (_brightness, _contrast, _saturation, _hue)


_IDENTITY = np.array([1.0, 1.0, 1.0, 0.0])  # albumentations skips an op whose factor is this (hue 0 included)


def device_jitter(x: torch.Tensor, factors: np.ndarray, order: np.ndarray) -> torch.Tensor:
    """albumentations' ColorJitter on (N, 3, H, W) float RGB of whole levels 0..255, in place (x
    is returned): factors (N, 4) float64 (brightness, contrast, saturation, hue) and order (N, 4)
    (op ids per position), on the host, where they are drawn. Per position, each op runs once on
    the images that have it there and a factor that changes anything; the host knows which
    without asking the device. About 100 elementwise passes per image (hue is most of them):
    trivial on a GPU, ~0.1 s per 256 x 256 image on a loaded CPU core."""
    f = torch.from_numpy(np.ascontiguousarray(factors, dtype=np.float64)).to(x.device, non_blocking=True)
    acts = factors != _IDENTITY
    for pos in range(order.shape[1]):
        for op, fn in enumerate(_OPS):
            idx = np.flatnonzero((order[:, pos] == op) & acts[:, op])
            if idx.size == len(order):
                out = fn(x, f[:, op])
                if out is not x:
                    x.copy_(out)
            elif idx.size:
                sel = torch.from_numpy(idx).to(x.device, non_blocking=True)
                x.index_copy_(0, sel, fn(x[sel], f[sel, op]))
    return x


@dataclass(frozen=True, slots=True)
class ColorJitter:
    """ColorJitter's ranges as Isaac-GR00T passes them (color_jitter_params): brightness, contrast
    and saturation factors U[max(0, 1 - v), 1 + v], hue U[-v, v] (a fraction of the hue circle)."""

    brightness: float = 0.3
    contrast: float = 0.4
    saturation: float = 0.5
    hue: float = 0.08

    def __post_init__(self):
        if min(self.brightness, self.contrast, self.saturation, self.hue) < 0 or self.hue > 0.5:
            raise ConfigError(f"{self}: factors must be >= 0 and hue in [0, 0.5]")

    def ranges(self) -> np.ndarray:
        """(4, 2): low and high of each factor."""
        return np.array([[max(0.0, 1 - v), 1 + v] for v in (self.brightness, self.contrast, self.saturation)]
                        + [[-self.hue, self.hue]])


@dataclass(frozen=True)
class ImageDraws:
    """Crop offsets and jitter, one row per sample (or per image, `per_image`)."""

    x0: np.ndarray  # (N,) int64, 0 .. edge - crop
    y0: np.ndarray
    factors: np.ndarray | None  # (N, 4) float64: brightness, contrast, saturation, hue; None: no jitter
    order: np.ndarray | None  # (N, 4) int64: the ops' order, a permutation of 0..3

    def __len__(self) -> int:
        return len(self.x0)

    def per_image(self, images: int) -> ImageDraws:
        """Each row repeated for a sample's `images` consecutive images (its frames and cameras)."""
        def rep(a):
            return None if a is None else np.repeat(a, images, axis=0)

        return ImageDraws(rep(self.x0), rep(self.y0), rep(self.factors), rep(self.order))

    def sample(self, i: int) -> tuple[tuple[int, int], Jitter | None]:
        """Row i for the reference path: ((x0, y0), its Jitter or None)."""
        if self.factors is None:
            return (int(self.x0[i]), int(self.y0[i])), None
        jit = Jitter(*map(float, self.factors[i]), order=tuple(map(int, self.order[i])))
        return (int(self.x0[i]), int(self.y0[i])), jit


IMAGE_STREAM = 1  # the draws' SeedSequence spawn key: apart from noise_for's stream (no spawn key)


def image_draws(seed: int, epoch: int, sample_ids, geo: Geometry = Geometry(),
                jitter: ColorJitter | None = ColorJitter(), stream: int = 0) -> ImageDraws:
    """The training draws of `sample_ids`, a pure function of (seed, epoch, sample id) as noise_for's
    (train/model/noise.py): a sample draws the same crop and jitter on any rank or batch layout.
    x0, y0 uniform over 0 .. edge - crop; factors uniform over `jitter.ranges()`; the order a
    uniform permutation (Isaac-GR00T: numpy's global RNG and Python's `random`; the distribution
    is the same, the numbers are not). `stream`: the root of a mixture (sample ids are per root)."""
    ids = np.asarray(sample_ids).reshape(-1)
    xy = np.empty((len(ids), 2), np.int64)
    factors, order = np.empty((len(ids), 4)), np.empty((len(ids), 4), np.int64)
    ranges = None if jitter is None else jitter.ranges()
    for i, sid in enumerate(ids.tolist()):
        key = [seed, epoch, int(sid)] if not stream else [seed, epoch, int(sid), stream]
        rng = np.random.default_rng(np.random.SeedSequence(key, spawn_key=(IMAGE_STREAM,)))
        xy[i] = rng.integers(0, geo.offsets, size=2)
        if ranges is not None:
            factors[i] = rng.uniform(ranges[:, 0], ranges[:, 1])
            order[i] = rng.permutation(4)
    if ranges is None:
        return ImageDraws(xy[:, 0], xy[:, 1], None, None)
    return ImageDraws(xy[:, 0], xy[:, 1], factors, order)
