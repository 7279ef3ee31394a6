"""Image features (PNG or JPEG bytes inside the data parquet, LIBERO-style) -> NV12.

The rule (FORMAT.md, "Image features"): each image is decoded with Pillow, the decoder
LeRobotDataset itself uses, and converted to 8-bit RGB (`Image.convert("RGB")`: grey and
palette images expanded, alpha dropped); when the stored size differs from the image's
(`--height/--width`), the RGB is centre-cropped (`--resize-mode crop`) and resized with
Pillow's bicubic filter; then `shared.color.rgb_to_nv12` converts it in the dataset's colour
matrix and range (BT.601 full range for a dataset of image features only, the video
streams' colour otherwise, or what --color-matrix/--color-range ask). Reading it back with
`shared.color.nv12_to_rgb` is within the chroma subsampling of the original pixels: NV12 keeps one
colour per 2x2 pixels (4:2:0), which video sources already had, but still images did not, so a sharp
colour edge comes back blended (142/255 at worst on LeRobot's PNG fixture). The loss is measured on
every image as it is converted (the stored frame read back against the RGB it was made from) and
recorded per camera in `dataset.source.image_color`; `loongforge preprocess` and `inspect` print it.
"""

from __future__ import annotations

import io

import numpy as np

from loongforge.preprocess.stages.colorspace import ColorTarget
from loongforge.preprocess.stages.decode import crop_box
from loongforge.shared import color
from loongforge.shared.errors import SourceDataError

FORMATS = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpeg"}


def _image_bytes(cell, origin: str) -> bytes:
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
        path = cell.get("path") if isinstance(cell, dict) else None
        raise SourceDataError(f"{origin}: no image bytes in the parquet (path {path!r}); LoongForge reads image "
                              "features embedded in the parquet, as LeRobot's writer stores them")
    return bytes(data)


def image_format(data: bytes) -> str:
    for magic, name in FORMATS.items():
        if data.startswith(magic):
            return name
    return "unknown"


def decode_rgb(data: bytes, origin: str) -> np.ndarray:
    """uint8 (h, w, 3) RGB of one PNG or JPEG."""
    try:
        from PIL import Image
    except ImportError as exc:  # optional dependency: only datasets with image features need it
        raise SourceDataError(f"{origin}: image features need Pillow (pip install 'loongforge[preprocess]')") \
            from exc
    if image_format(data) == "unknown":
        raise SourceDataError(f"{origin}: image bytes are neither PNG nor JPEG (first bytes {data[:4]!r})")
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except (OSError, ValueError) as exc:
        raise SourceDataError(f"{origin}: unreadable image ({exc})") from exc


def _fit(rgb: np.ndarray, height: int, width: int, resize_mode: str) -> np.ndarray:
    from PIL import Image

    h, w = rgb.shape[:2]
    if resize_mode == "crop":
        y0, x0, ch, cw = crop_box(h, w, height, width)
        rgb = rgb[y0 : y0 + ch, x0 : x0 + cw]
    return np.asarray(Image.fromarray(np.ascontiguousarray(rgb)).resize((width, height), Image.BICUBIC))


def images_to_nv12(cells: list, out: np.ndarray, *, resize_mode: str, target: ColorTarget,
                   origin: str) -> tuple[int, int, str, tuple[int, int, int]]:
    """Decode every row's image into `out` (n, 3h/2, w) NV12. Returns the source (height, width,
    format) of the first image, and the colour lost to 4:2:0 chroma over every image: (largest
    |difference| in 1/255, sum of |differences|, values compared) between the stored frame read back
    (shared.color.nv12_to_rgb, the trainer's reference) and the RGB it was made from. Every image of a
    camera must have the same size."""
    n, rows, width = out.shape
    height = rows * 2 // 3
    src, worst, total = None, 0, 0
    for i, cell in enumerate(cells):
        where = f"{origin} row {i}"
        data = _image_bytes(cell, where)
        rgb = decode_rgb(data, where)
        if src is None:
            src = (rgb.shape[0], rgb.shape[1], image_format(data))
        elif rgb.shape[:2] != src[:2]:
            raise SourceDataError(f"{where}: image is {rgb.shape[0]}x{rgb.shape[1]}, the first was {src[0]}x{src[1]}")
        if rgb.shape[:2] != (height, width):
            rgb = _fit(rgb, height, width, resize_mode)
        out[i] = color.rgb_to_nv12(rgb, target.matrix, target.range)
        diff = np.abs(color.nv12_to_rgb(out[i], target.matrix, target.range).astype(np.int16) - rgb)
        worst, total = max(worst, int(diff.max())), total + int(diff.sum())
    if src is None or len(cells) != n:
        raise SourceDataError(f"{origin}: {len(cells)} images for {n} rows")
    return (*src, (worst, total, n * height * width * 3))


def image_color(staged) -> dict:
    """`dataset.source.image_color`: per image-feature camera, the colour its NV12 lost against the
    source images over the converted episodes (StagedEpisode.image_loss), in 1/255."""
    acc: dict[str, list[int]] = {}
    for ep in staged:
        for key, worst, total, values in ep.image_loss:
            a = acc.setdefault(key, [0, 0, 0])
            a[0], a[1], a[2] = max(a[0], worst), a[1] + total, a[2] + values
    return {key: {"chroma": "4:2:0", "max_255": worst, "mean_255": round(total / values, 4) if values else 0.0}
            for key, (worst, total, values) in sorted(acc.items())}
