"""Rewrite a generated LeRobot v2.0 dataset in the layouts LeRobot writes today.

    write_v3("data/sample", "data/sample_v3", codec="av1", gop=2)   # v3.0: episodes concatenated
    write_v21("data/sample")                                        # v2.0 -> v2.1 in place
    write_v3(..., stamps=wall_clock(fps, seed=0))                   # v3.0 as a real robot records it
    shift_timestamps("data/sample_v3", frames=1)                    # rows stamped from 1/fps, as GR00T's

`write_v3` is what LeRobot >= 0.4 produces (`LeRobotDataset.create` ... `finalize`): every camera's
episodes re-encoded (H.264, HEVC or AV1, a keyframe every `gop` frames, yuv420p) and concatenated,
`episodes_per_file` to an mp4, so each episode starts on a keyframe at its `from_timestamp`; the
episodes' rows concatenated into data files; `meta/episodes/chunk-000/file-000.parquet`,
`meta/tasks.parquet`, `meta/stats.json`. The frames come from decoding the source mp4s, so the
content is the sample generator's; only the encoding and the layout change. `write_v21` adds
`meta/episodes_stats.jsonl` (v2.1's per-episode statistics) and drops stats.json.
"""

from __future__ import annotations

import json
import os
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np

from loongforge.preprocess.stages.discover import discover
from loongforge.shared.errors import ConfigError

ENCODERS = {"h264": "libx264", "hevc": "libx265", "av1": "libsvtav1"}
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"


def _decode_i420(path: str) -> list[np.ndarray]:
    import av

    with av.open(path) as container:
        return [f.to_ndarray(format="yuv420p") for f in container.decode(video=0)]


TIME_BASE = 90000  # ticks per second of a variable-frame-rate stream (MPEG's clock)


def _encode(path: Path, episodes: list[list[np.ndarray]], *, fps: int, codec: str, gop: int, crf: int,
            times: list[np.ndarray] | None = None) -> None:
    """One mp4 of the episodes in order, frame pts = frame number, an I frame at each episode start.
    `times`: per episode, each frame's presentation time from the episode's start (seconds; a
    variable frame rate, 1/90000 s ticks); episode e starts at sum of the earlier lengths / fps."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    rows, width = episodes[0][0].shape
    options = {"threads": "1"}
    if codec == "h264":
        options.update({"crf": str(crf), "preset": "veryfast",
                        "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:mbtree=0"})
    elif codec == "hevc":
        options.update({"crf": str(crf), "preset": "veryfast",
                        "x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=error:pools=1"})
    else:
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its configuration to stderr at info level
        options.update({"crf": str(crf), "preset": "12"})
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(ENCODERS[codec], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, rows * 2 // 3, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.options = options
        if times is not None:
            stream.codec_context.time_base = stream.time_base = Fraction(1, TIME_BASE)
        pts, start = 0, 0
        for e, frames in enumerate(episodes):
            for i, i420 in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(i420, format="yuv420p")
                if times is not None:
                    frame.pts = int(round((start / fps + float(times[e][i])) * TIME_BASE))
                    frame.time_base = Fraction(1, TIME_BASE)
                else:
                    frame.pts = pts
                if i == 0:
                    frame.pict_type = av.video.frame.PictureType.I
                out.mux(stream.encode(frame))
                pts += 1
            start += len(frames) if times is None else _rows(times[e], fps)
        out.mux(stream.encode())


def _rows(times: np.ndarray, fps: int) -> int:
    """Rows of an episode recorded with these frame times (a frame every 1/fps, some dropped)."""
    return int(round(float(times[-1]) * fps)) + 1 if len(times) else 0


def wall_clock(fps: int, *, jitter: float = 0.3, drop_every: int = 7, seed: int = 0):
    """Stamps as a real robot records them: for row i of an episode, the camera's frame is captured
    at i/fps + u (u uniform in +-jitter/fps, 0 for the first row) and every `drop_every`-th frame
    (from the 3rd) is dropped by the camera; the row keeps the capture time as its timestamp. Gives
    `stamps(episode, n) -> (row timestamps (n,), kept frame rows)` for `write_v3`."""
    def stamps(episode: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([seed, episode])
        t = np.arange(n) / fps + rng.uniform(-jitter, jitter, n) / fps
        t[0] = 0.0
        kept = np.ones(n, bool)
        if drop_every:
            kept[2::drop_every] = False
        kept[[0, -1]] = True  # an episode's first and last frames are there: its span stays n / fps
        return t.astype(np.float32), np.flatnonzero(kept)
    return stamps


def shift_timestamps(root: str | Path, *, frames: int = 1) -> Path:
    """Rewrite a v3.0 dataset's `timestamp` column `frames` frame periods later (float32), leaving
    the videos: rows stamped from 1/fps, as GR00T's demo data is. Row r then points at the
    video's frame r + frames; an episode's last rows point past its span."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    fps = json.loads((root / "meta" / "info.json").read_text())["fps"]
    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        col = table.schema.get_field_index("timestamp")
        ts = table.column(col).to_numpy().astype(np.float64) + frames / fps
        pq.write_table(table.set_column(col, "timestamp", pa.array(ts.astype(np.float32))), path)
    return root


def _stats(rows: np.ndarray) -> dict:
    x = np.asarray(rows, np.float64)
    return {"min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
            "count": [int(len(x))]}


def write_v3(src: str | Path, out: str | Path, *, codec: str = "av1", gop: int = 2, crf: int = 30,
             episodes_per_file: int = 0, stamps=None) -> Path:
    """Write `src` (a v2.x dataset with video cameras) as a v3.0 dataset under `out`.
    `episodes_per_file`: episodes per data/video file (0: all in one). `stamps`: per episode,
    (row timestamps, rows whose frame the video keeps) as `wall_clock` gives; None: 0, 1/fps, ...
    and every frame."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if codec not in ENCODERS:
        raise ConfigError(f"codec {codec!r}: choose one of {sorted(ENCODERS)}")
    if gop < 1:
        raise ConfigError(f"gop {gop}: must be >= 1")
    meta, episodes = discover(str(src))
    out = Path(out)
    fps = int(round(meta.fps))
    per_file = episodes_per_file or len(episodes)
    groups = [episodes[i:i + per_file] for i in range(0, len(episodes), per_file)]
    tables = [pq.read_table(e.parquet) for e in episodes]
    stamped = {}
    if stamps is not None:
        for k, e in enumerate(episodes):
            ts, kept = stamps(e.index, tables[k].num_rows)
            stamped[e.index] = (np.asarray(ts, np.float64), np.asarray(kept))
            col = tables[k].schema.get_field_index("timestamp")
            tables[k] = tables[k].set_column(col, "timestamp", pa.array(np.asarray(ts, np.float32)))
    ep_rows, first, data_tables = [], 0, []
    for file_index, group in enumerate(groups):
        for cam in meta.cameras:
            clips = [_decode_i420(dict(e.videos)[cam.key]) for e in group]
            times = None
            if stamps is not None:
                clips = [[clip[i] for i in stamped[e.index][1]] for clip, e in zip(clips, group)]
                times = [stamped[e.index][0][stamped[e.index][1]] for e in group]
            _encode(out / VIDEO_PATH.format(video_key=cam.key, chunk_index=0, file_index=file_index), clips,
                    fps=fps, codec=codec, gop=gop, crf=crf, times=times)
        offset = 0.0
        for e in group:
            table = tables[episodes.index(e)]
            n = table.num_rows
            row = {"episode_index": e.index, "tasks": list(e.tasks), "length": n, "data/chunk_index": 0,
                   "data/file_index": file_index, "dataset_from_index": first, "dataset_to_index": first + n}
            for cam in meta.cameras:
                key = f"videos/{cam.key}/"
                row.update({key + "chunk_index": 0, key + "file_index": file_index, key + "from_timestamp": offset,
                            key + "to_timestamp": offset + n / fps})
            ep_rows.append(row)
            offset += n / fps
            first += n
        data = pa.concat_tables([tables[episodes.index(e)] for e in group])
        path = out / DATA_PATH.format(chunk_index=0, file_index=file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, path)
        data_tables.append(data)
    _write_meta(src, out, meta, ep_rows, data_tables, codec, gop, fps)
    return out


def _write_meta(src, out: Path, meta, ep_rows, data_tables, codec, gop, fps) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    info = json.loads((Path(src) / "meta" / "info.json").read_text())
    kept = {c.key for c in meta.cameras}
    for key in [k for k, f in info["features"].items() if f.get("dtype") == "video" and k not in kept]:
        del info["features"][key]  # a camera without files (the source's quirk): LeRobot would look for its mp4s
    for cam in meta.cameras:
        info["features"][cam.key]["info"] = {"video.height": cam.height, "video.width": cam.width,
                                             "video.codec": codec, "video.pix_fmt": "yuv420p", "video.fps": fps,
                                             "video.g": gop, "has_audio": False}
        info["features"][cam.key].pop("video_info", None)
    info.update({"codebase_version": "v3.0", "data_path": DATA_PATH, "video_path": VIDEO_PATH,
                 "total_episodes": len(ep_rows), "total_frames": sum(r["length"] for r in ep_rows),
                 "chunks_size": 1000, "splits": {"train": f"0:{len(ep_rows)}"}})
    info.pop("total_chunks", None)
    info.pop("total_videos", None)
    (out / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4) + "\n")
    pq.write_table(pa.Table.from_pylist(ep_rows), out / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    import pandas as pd  # the preprocess extra, as pyarrow

    tasks = sorted(meta.tasks.items())
    # LeRobot's layout: a pandas frame indexed by the task string (`meta.tasks.iloc[i].name` is the text).
    pd.DataFrame({"task_index": [i for i, _ in tasks]}, index=pd.Index([t for _, t in tasks], name="task")) \
        .to_parquet(out / "meta" / "tasks.parquet")
    data = pa.concat_tables(data_tables)
    stats = {key: _stats(np.array(data.column(key).to_pylist(), np.float32)) for key in ("observation.state", "action")}
    (out / "meta" / "stats.json").write_text(json.dumps(stats, indent=4) + "\n")
    if (Path(src) / "meta" / "modality.json").exists():
        shutil.copy(Path(src) / "meta" / "modality.json", out / "meta" / "modality.json")


def write_v21(root: str | Path) -> Path:
    """Turn a generated v2.0 dataset into v2.1 in place: per-episode statistics of state and action in
    meta/episodes_stats.jsonl (LeRobot's v2.1 layout), codebase_version "v2.1", no stats.json."""
    import pyarrow.parquet as pq

    root = Path(root)
    _, episodes = discover(str(root))
    lines = []
    for e in episodes:
        table = pq.read_table(e.parquet)
        stats = {key: _stats(np.array(table.column(key).to_pylist(), np.float32))
                 for key in ("observation.state", "action")}
        lines.append(json.dumps({"episode_index": e.index, "stats": stats}))
    (root / "meta" / "episodes_stats.jsonl").write_text("\n".join(lines) + "\n")
    (root / "meta" / "stats.json").unlink(missing_ok=True)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["codebase_version"] = "v2.1"
    info_path.write_text(json.dumps(info, indent=4) + "\n")
    return root
