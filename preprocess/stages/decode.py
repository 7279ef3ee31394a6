"""Stage 3: decode one camera's mp4 to NV12 frames at the configured resolution.

Each episode is decoded ONCE, front to back (`container.decode`): a seek per frame
would re-decode from the previous keyframe every time, which at GOP 100+ costs
~GOP/2 decodes per frame. The whole episode lands in one preallocated
(n, 3h/2, w) uint8 buffer; its blocks are then encoded from it without re-decoding.

An episode inside a file holding several (LeRobot v3.0) is its `span` [from, to) in seconds:
the decoder seeks to the keyframe at or before `from` (never decodes the file from its start
for a later episode) and considers exactly the frames whose presentation time t satisfies
from - p/2 <= t < to - p/2 (p: one frame period): the first and last frame of the episode and
no frame of a neighbour. Row r gets the frame of those nearest `from + timestamp[r]`, what
LeRobotDataset shows for it (stages/timing.py: the identity for stamps 0, 1/fps, ...; rows
without a frame within the tolerance are clamped, skipped or fail the episode).

Colour: H.264 from LeRobot is yuv420p; repacking its planes to NV12 is lossless
(no matrix or range conversion), so the NV12 carries the source's colour
matrix and range (detected per stream, stages/colorspace.py). Only when the job asks
for another colour (--color-range/--color-matrix) is a stream converted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from loongforge.preprocess import files
from loongforge.preprocess.stages.colorspace import SWS_MATRIX, SWS_RANGE, UNTAGGED, ColorTarget, StreamColor, \
    check_stream, stream_color
from loongforge.preprocess.stages.timing import FrameMismatch, FrameTiming, NearestFrames, RowFrames
from loongforge.shared.errors import SourceDataError

YUV420 = ("yuv420p", "yuvj420p")  # same planes; yuvj is full range (kept as is, recorded)


@dataclass(frozen=True, slots=True)
class VideoInfo:
    height: int  # source
    width: int
    codec: str
    pix_fmt: str
    color_matrix: str  # bt601 | bt709, of the source stream
    frames: int  # decoded
    color_range: str = "limited"  # of the source stream
    rows: RowFrames | None = None  # which frame each row shows, when rows were given by timestamp


def crop_box(src_h: int, src_w: int, dst_h: int, dst_w: int) -> tuple[int, int, int, int]:
    """Largest centred (y0, x0, h, w) region with the target aspect ratio, on the
    2x2 chroma grid so the NV12 planes crop consistently."""
    if src_h * dst_w > src_w * dst_h:  # source is taller than the target aspect
        w = src_w
        h = src_w * dst_h // dst_w
    else:
        h = src_h
        w = src_h * dst_w // dst_h
    h, w = max(2, h - h % 2), max(2, w - w % 2)
    y0, x0 = (src_h - h) // 2, (src_w - w) // 2
    return y0 - y0 % 2, x0 - x0 % 2, h, w


def _plane(frame, i: int, width: int) -> np.ndarray:
    """Zero-copy view of plane i without its line padding."""
    p = frame.planes[i]
    return np.frombuffer(p, np.uint8).reshape(p.height, p.line_size)[:, :width]


class NV12Converter:
    """Frame -> NV12 into a caller's buffer row; the mode is fixed per file.

    Speed (benchmarks/loader/preprocess.py): `frame.reformat()` builds a new swscale
    context on every call, which cost ~5x the H.264 decode itself at 128x128.
    So: same-size yuv420p is repacked in numpy (two plane copies, exact), and
    scaling goes through one reused VideoReformatter (cached swscale context)."""

    def __init__(self, src_h: int, src_w: int, height: int | None, width: int | None, resize_mode: str,
                 source: StreamColor = UNTAGGED, target: ColorTarget | None = None):
        from av.video.reformatter import VideoReformatter

        convert = target is not None and (target.matrix, target.range) != (source.matrix, source.range)
        self.color = (source, target) if convert else None
        # The range frames are in when they reach scaling/cropping, passed to swscale as
        # both source and destination so that scaling never converts range on its own.
        self.sws_range = SWS_RANGE[target.range if convert else source.range]
        self.src = (src_h, src_w)
        self.dst = (height or src_h, width or src_w)
        self.box = crop_box(src_h, src_w, *self.dst) if resize_mode == "crop" else None
        if self.box is not None and self.box[2:] == self.src:
            self.box = None  # same aspect: a crop is a plain resize
        self.reformatter = VideoReformatter()

    def __call__(self, frame, out: np.ndarray) -> None:
        h, w = self.dst
        if self.color is not None:
            frame = self._convert(frame)
        if self.box is not None:
            self._crop(frame, out)
        elif self.src == self.dst and frame.format.name in YUV420:
            out[:h] = _plane(frame, 0, w)
            out[h:, 0::2] = _plane(frame, 1, w // 2)
            out[h:, 1::2] = _plane(frame, 2, w // 2)
        else:
            out[...] = self.reformatter.reformat(frame, width=w, height=h, format="nv12",
                                                 src_color_range=self.sws_range,
                                                 dst_color_range=self.sws_range).to_ndarray()

    def _convert(self, frame):
        """Source colour -> target colour at source size, as yuv420p (swscale).
        A matrix change goes through RGB (swscale applies matrices only there)."""
        src, dst = self.color
        if src.matrix != dst.matrix:
            frame = self.reformatter.reformat(frame, format="rgb24", src_colorspace=SWS_MATRIX[src.matrix],
                                              src_color_range=SWS_RANGE[src.range])
            return self.reformatter.reformat(frame, format="yuv420p", dst_colorspace=SWS_MATRIX[dst.matrix],
                                             dst_color_range=SWS_RANGE[dst.range])
        return self.reformatter.reformat(frame, format="yuv420p", src_color_range=SWS_RANGE[src.range],
                                         dst_color_range=SWS_RANGE[dst.range])

    def _crop(self, frame, out: np.ndarray) -> None:
        import av

        if frame.format.name not in YUV420:
            frame = self.reformatter.reformat(frame, format="yuv420p", src_color_range=self.sws_range,
                                              dst_color_range=self.sws_range)
        src_w = self.src[1]
        y0, x0, ch, cw = self.box
        yc = _plane(frame, 0, src_w)[y0 : y0 + ch, x0 : x0 + cw]
        uc = _plane(frame, 1, src_w // 2)[y0 // 2 : (y0 + ch) // 2, x0 // 2 : (x0 + cw) // 2]
        vc = _plane(frame, 2, src_w // 2)[y0 // 2 : (y0 + ch) // 2, x0 // 2 : (x0 + cw) // 2]
        h, w = self.dst
        if (ch, cw) == (h, w):
            out[:h] = yc
            out[h:, 0::2] = uc
            out[h:, 1::2] = vc
            return
        i420 = np.concatenate((yc.reshape(-1), uc.reshape(-1), vc.reshape(-1))).reshape(ch * 3 // 2, cw)
        cropped = av.VideoFrame.from_ndarray(i420, format="yuv420p")
        out[...] = self.reformatter.reformat(cropped, width=w, height=h, format="nv12", src_color_range=self.sws_range,
                                             dst_color_range=self.sws_range).to_ndarray()


def _span_window(stream, span: tuple[float, float], n_frames: int) -> tuple[float, float, float]:
    """(lo, hi, period): the frames a span holds are those at lo <= t < hi seconds, half a frame
    period before each end, so a frame a rounding error off its nominal time lands in the right episode."""
    start, end = span
    rate = stream.average_rate or stream.guessed_rate
    period = float(1 / rate) if rate else (end - start) / max(1, n_frames)
    return start - period / 2, end - period / 2, period


def _time(frame, stream) -> float:
    return float(frame.pts * stream.time_base) if frame.pts is not None else float(frame.time or 0.0)


def _frames(container, stream, window: tuple[float, float, float] | None):
    """The stream's frames in presentation order, limited to `window` when given: seek to the
    keyframe at or before lo, skip what precedes lo, stop at hi. A seek that lands past the
    span's first frame (a file without a usable index) falls back to decoding from the start."""
    frames = container.decode(stream)
    if window is None:
        yield from frames
        return
    lo, hi, period = window
    if lo > 0:
        container.seek(int(lo / stream.time_base), stream=stream, backward=True, any_frame=False)
        frames = container.decode(stream)
        first = next(frames, None)
        if first is not None and _time(first, stream) > lo + period:
            container.seek(0, stream=stream, backward=True, any_frame=False)
            frames = container.decode(stream)
        elif first is not None:
            frames = itertools.chain((first,), frames)
    for frame in frames:
        t = _time(frame, stream)
        if t >= hi:
            return
        if t >= lo:
            yield frame


def decode_nv12(path: str, rows, *, height: int | None = None, width: int | None = None,
                resize_mode: str = "resize", threads: int = 1, color: ColorTarget | None = None,
                span: tuple[float, float] | None = None,
                timing: FrameTiming | None = None) -> tuple[np.ndarray, VideoInfo]:
    """NV12 frames of the first video stream, one per row, from the file's frames (those of `span`,
    [from, to) seconds, when the file holds several episodes).
    `rows`: the parquet's timestamps (seconds of episode time, one per row): each row gets the frame
    nearest `from + timestamp` (stages/timing.py, by `timing`; `VideoInfo.rows` says which); or a
    row count: exactly that many frames, frame i for row i.
    `color`: the dataset's colour; None keeps the stream's own (and records it).

    Raises SourceDataError when the file is missing or unreadable, holds no frame for the rows
    (a row count: a different number of frames), a row has no frame within the tolerance under
    mismatch "fail", or the stream is in another colour than `color` when `color` does not ask to
    convert."""
    import av

    mapper = None
    if isinstance(rows, (int, np.integer)):
        n_rows = int(rows)
    else:
        times = np.asarray(rows, np.float64)
        n_rows = len(times)
        mapper = NearestFrames(times + (span[0] if span is not None else 0.0), timing or FrameTiming())
    where = f"{path} [{span[0]:g}, {span[1]:g}) s" if span is not None else path
    try:
        with files.open_read(path) as f, av.open(f, mode="r") as container:
            if not container.streams.video:
                raise SourceDataError(f"{path}: no video stream")
            stream = container.streams.video[0]
            # One thread by default: the job already runs one worker per core,
            # and frame-threaded decoding adds latency without adding throughput.
            stream.codec_context.thread_count = threads
            if threads != 1:
                stream.thread_type = "AUTO"
            cc = stream.codec_context
            src_h, src_w = cc.height, cc.width
            if src_h % 2 or src_w % 2:
                raise SourceDataError(f"{path}: odd source size {src_h}x{src_w}; NV12 needs even sizes")
            got = stream_color(cc)
            target = color if color is not None else ColorTarget(got.matrix, got.range)
            check_stream(path, got, target)  # refuses another colour unless conversion was asked for
            convert = NV12Converter(src_h, src_w, height, width, resize_mode, got, target)
            h, w = convert.dst
            out = np.empty((n_rows, h * 3 // 2, w), dtype=np.uint8)
            window = _span_window(stream, span, n_rows) if span is not None else None
            if mapper is None:
                count = _decode_count(container, stream, window, convert, out, where, span)
            else:
                count = _decode_nearest(container, stream, window, convert, out, mapper)
            info = VideoInfo(height=src_h, width=src_w, codec=cc.name, pix_fmt=str(cc.pix_fmt),
                             color_matrix=got.matrix, frames=count, color_range=got.range,
                             rows=mapper.result() if mapper is not None else None)
    except FileNotFoundError:
        raise SourceDataError(f"{path}: video file missing") from None
    except av.FFmpegError as exc:
        raise SourceDataError(f"{path}: unreadable video ({type(exc).__name__}: {exc})") from exc
    except FrameMismatch as exc:
        raise SourceDataError(f"{where}: {exc}; the episode's video has {mapper.seen} frames for {n_rows} rows "
                              "(--frame-mismatch clamp or skip converts it)") from None
    if mapper is None and count != n_rows:
        raise SourceDataError(f"{where}: length mismatch: video has {count} frames, parquet {n_rows} rows")
    if mapper is not None and count == 0 and n_rows:
        raise SourceDataError(f"{where}: no video frame in the episode's span for its {n_rows} rows")
    return out, info


def _decode_count(container, stream, window, convert, out: np.ndarray, where: str, span) -> int:
    """Frame i into row i; more frames than rows is a length mismatch."""
    count = 0
    for frame in _frames(container, stream, window):
        if count == len(out):
            total = "more" if span is not None else stream.frames or "more"
            raise SourceDataError(f"{where}: length mismatch: video has {total} frames, parquet {len(out)} rows")
        convert(frame, out[count])
        count += 1
    return count


def _decode_nearest(container, stream, window, convert, out: np.ndarray, mapper: NearestFrames) -> int:
    """Each frame converted once, into the first row it serves, copied to the others (rows stamped
    between two frames may share one); a frame no row is nearest to is decoded, never converted."""

    def write(served) -> None:
        if served is not None and len(served[0]):
            rows, frame = served
            convert(frame, out[rows[0]])
            out[rows[1:]] = out[rows[0]]

    count = 0
    for frame in _frames(container, stream, window):
        write(mapper.push(_time(frame, stream), frame))
        count += 1
    write(mapper.finish())
    return count
