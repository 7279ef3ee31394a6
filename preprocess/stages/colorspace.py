"""Colour matrix and range of each source video stream, and the job's policy.

NV12 is stored as the source's YUV bytes (no conversion when nothing is asked),
so the index must say which matrix and range those bytes are in. Full-range
("JPEG", `yuvj420p`, `color_range=2`) and limited-range streams hold different
numbers for the same picture: a dataset whose cameras disagree cannot carry
one `color_range` and is refused unless `--color-range` / `--color-matrix`
says what to convert every stream to.

Launcher side: `probe_colors` opens each camera's first video (metadata only,
no decode) and `resolve_colors` picks the dataset's target or raises. Worker
side: `stream_color` reads the same from each stream `decode_nv12` opens.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.preprocess import files
from loongforge.shared.errors import ConfigError, SourceDataError

AVCOL_SPC_BT709 = 1  # FFmpeg's AVColorSpace value for BT.709
AVCOL_RANGE_JPEG = 2  # FFmpeg's AVColorRange: full range
# swscale's names for what the index calls bt601/bt709 and limited/full.
SWS_MATRIX = {"bt601": "ITU601", "bt709": "ITU709"}
SWS_RANGE = {"limited": "MPEG", "full": "JPEG"}


@dataclass(frozen=True, slots=True)
class StreamColor:
    matrix: str  # bt601 | bt709
    range: str  # limited | full


UNTAGGED = StreamColor(matrix="bt601", range="limited")
# The colour image features are stored in when no video stream sets one: JPEG's own YCbCr
# (BT.601, full range) keeps the most levels of 8-bit RGB.
IMAGES_ONLY = StreamColor(matrix="bt601", range="full")


@dataclass(frozen=True, slots=True)
class ColorTarget:
    """The colour every stream's NV12 ends up in. `convert`: the user asked for
    it, so a stream in another colour is converted; otherwise it is refused."""

    matrix: str = "bt601"
    range: str = "limited"
    convert: bool = False


def stream_color(codec_context) -> StreamColor:
    """Untagged streams are BT.601 (what swscale also assumes for RGB) and
    limited range; `yuvj*` pixel formats are full range whatever the tag says."""
    pix_fmt = str(codec_context.pix_fmt or "")
    full = codec_context.color_range == AVCOL_RANGE_JPEG or pix_fmt.startswith("yuvj")
    matrix = "bt709" if codec_context.colorspace == AVCOL_SPC_BT709 else "bt601"
    return StreamColor(matrix=matrix, range="full" if full else "limited")


def probe_stream(path: str) -> StreamColor:
    import av

    try:
        with files.open_read(path) as f, av.open(f, mode="r") as container:
            if not container.streams.video:
                raise SourceDataError(f"{path}: no video stream")
            return stream_color(container.streams.video[0].codec_context)
    except FileNotFoundError:
        raise SourceDataError(f"{path}: video file missing") from None
    except av.FFmpegError as exc:
        raise SourceDataError(f"{path}: unreadable video ({exc})") from exc


def probe_colors(episodes) -> dict[str, StreamColor]:
    """camera key -> colour of its first readable video. Unreadable files are
    left to the convert stage (they become failed records there)."""
    found: dict[str, StreamColor] = {}
    for spec in episodes:
        for camera, path in spec.videos:
            if camera not in found:
                try:
                    found[camera] = probe_stream(path)
                except SourceDataError:
                    continue
        if len(found) == len({c for c, _ in spec.videos}):
            break
    return found


def dataset_colors(episodes, has_video: bool, color_range: str = "auto", color_matrix: str = "auto") -> ColorTarget:
    """The colour every camera's NV12 is stored in: the video streams' (probed), or IMAGES_ONLY for a
    dataset of image features only; --color-range/--color-matrix override either."""
    probed = probe_colors(episodes) if has_video else {"images": IMAGES_ONLY}
    return resolve_colors(probed, color_range, color_matrix)


def resolve_colors(probed: dict[str, StreamColor], color_range: str = "auto",
                   color_matrix: str = "auto") -> ColorTarget:
    """The dataset's colour: the sources' own when they agree (and nothing is
    asked), else the one asked for; disagreeing cameras without a choice raise."""
    picked = {}
    for what, asked, flag in (("range", color_range, "--color-range limited|full"),
                              ("matrix", color_matrix, "--color-matrix bt601|bt709")):
        if asked != "auto":
            picked[what] = asked
            continue
        seen = {getattr(c, what) for c in probed.values()}
        if len(seen) > 1:
            each = ", ".join(f"{cam} {getattr(c, what)}" for cam, c in sorted(probed.items()))
            raise ConfigError(f"cameras disagree on colour {what} ({each}); one index records one {what}: "
                              f"pass {flag} to convert every stream to it")
        picked[what] = seen.pop() if seen else getattr(UNTAGGED, what)
    return ColorTarget(matrix=picked["matrix"], range=picked["range"],
                       convert=color_range != "auto" or color_matrix != "auto")


def check_stream(path: str, got: StreamColor, target: ColorTarget) -> bool:
    """True when the stream must be converted; raises when it differs and no
    conversion was asked (a camera of another episode encoded differently)."""
    if (got.matrix, got.range) == (target.matrix, target.range):
        return False
    if target.convert:
        return True
    raise SourceDataError(f"{path}: colour {got.matrix}/{got.range} but the dataset is {target.matrix}/"
                          f"{target.range} (from the first episode); pass --color-range/--color-matrix to convert")
