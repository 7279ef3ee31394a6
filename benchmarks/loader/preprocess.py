"""Preprocess throughput against PyAV on the same files, timed in one run.

    loongforge bench preprocess [--quick]

Generates a LeRobot v2 dataset (H.264, GOP >= 100), then times on the same mp4s:
  decode-only        PyAV sequential decode, one thread (the floor: every
                     pipeline has to decode each frame once)
  decode+nv12        the same plus PyAV's frame.reformat(format="nv12") per
                     frame into a preallocated buffer (plain PyAV usage)
  decode+nv12-job    decode plus the job's own NV12 repack (decode.NV12Converter),
                     i.e. the decode stage without Beam, blocks, zstd or IO
  seek-per-frame     the random-access pattern the job avoids: seek to each
                     frame's timestamp and decode forward from the keyframe
  job, 1 worker      the whole Beam job in-process (start-up included)
  job, N workers     the whole Beam job, one worker process per core
Frames are source frames x cameras. `per_core` divides by the processes used.
`run(quick)` returns the rows as dicts (folded into `loongforge bench data`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from loongforge.preprocess.stages.decode import NV12Converter
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.config import default_workers
from loongforge.preprocess.samples.dataset import generate_dataset

QUICK = {"episodes": 4, "frames": (150, 150), "height": 128, "width": 128, "gop": 100}
FULL = {"episodes": 8, "frames": (300, 300), "height": 256, "width": 256, "gop": 120}
SEEK_FRAMES = 40  # seek-per-frame is slow by design; time a prefix of one file


def _videos(root: Path) -> list[Path]:
    return sorted(root.rglob("*.mp4"))


def _decode_all(videos: list[Path], nv12: str = "") -> int:
    """nv12: "" = decode only; "pyav" = frame.reformat(format="nv12") per frame
    (plain PyAV usage); "job" = the job's NV12Converter (numpy repack)."""
    import av


    n = 0
    for path in videos:
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            stream.codec_context.thread_count = 1
            h, w = stream.codec_context.height, stream.codec_context.width
            buf = np.empty((h * 3 // 2, w), np.uint8)
            convert = NV12Converter(h, w, None, None, "resize")
            for frame in c.decode(stream):
                if nv12 == "pyav":
                    buf[...] = frame.reformat(format="nv12").to_ndarray()
                elif nv12 == "job":
                    convert(frame, buf)
                n += 1
    return n


def _seek_per_frame(path: Path, frames: int) -> int:
    import av

    n = 0
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        stream.codec_context.thread_count = 1
        tb = stream.time_base
        rate = stream.average_rate
        for i in range(frames):
            target = int(round(i / rate / tb))
            c.seek(target, stream=stream, backward=True, any_frame=False)
            for frame in c.decode(stream):
                if frame.pts is not None and frame.pts >= target:
                    frame.reformat(format="nv12").to_ndarray()
                    n += 1
                    break
    return n


def _timed(fn, repeats: int) -> tuple[int, float]:
    times, count = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        count = fn()
        times.append(time.perf_counter() - t0)
    return count, statistics.median(times)


def _job(dataset: Path, out: Path, workers: int) -> tuple[int, float]:
    mode = ["--direct_running_mode=in_memory", "--direct_num_workers=1"] if workers == 1 else []
    cfg = PreprocessConfig(input=str(dataset), output=str(out), workers=workers)
    t0 = time.perf_counter()
    summary = run_job(cfg, mode)
    seconds = time.perf_counter() - t0
    if summary["failed"]:
        raise RuntimeError(f"preprocess job had failures: {summary['failed_records']}")
    return summary["source_frames"] * len(summary["cameras"]), seconds


def _row(rid: str, title: str, frames: int, seconds: float, processes: int, baseline: float | None) -> dict:
    fps = frames / seconds if seconds > 0 else 0.0
    return {"id": rid, "title": title, "frames": frames, "seconds": round(seconds, 3), "processes": processes,
            "frames_per_s": round(fps, 1), "per_core": round(fps / processes, 1),
            "vs_decode_nv12": round(fps / processes / baseline, 3) if baseline else None, "status": "ok"}


def run(quick: bool) -> list[dict]:
    spec = QUICK if quick else FULL
    repeats = 1 if quick else 3
    cores = default_workers()
    with tempfile.TemporaryDirectory(prefix="lf-bench-pre-") as tmp:
        dataset = generate_dataset(Path(tmp) / "ds", **spec)
        videos = _videos(dataset)
        n, t_dec = _timed(lambda: _decode_all(videos), repeats)
        n2, t_nv12 = _timed(lambda: _decode_all(videos, "pyav"), repeats)
        n3, t_job_nv12 = _timed(lambda: _decode_all(videos, "job"), repeats)
        base = n2 / t_nv12
        rows = [_row("decode-only", "PyAV decode only (1 thread, sequential)", n, t_dec, 1, base),
                _row("decode+nv12", "PyAV decode + frame.reformat('nv12') (1 thread)", n2, t_nv12, 1, base),
                _row("decode+nv12-job", "PyAV decode + the job's NV12 repack (numpy planes)", n3, t_job_nv12, 1,
                     base)]
        seek_n, t_seek = _timed(lambda: _seek_per_frame(videos[0], SEEK_FRAMES), 1)
        rows.append(_row("seek-per-frame", f"PyAV seek + decode per frame ({SEEK_FRAMES} frames, GOP "
                         f"{spec['gop']})", seek_n, t_seek, 1, base))
        frames, t_job1 = _job(dataset, Path(tmp) / "out1", 1)
        rows.append(_row("job-1", "loongforge preprocess, 1 worker in-process (start-up included)", frames,
                         t_job1, 1, base))
        frames, t_jobn = _job(dataset, Path(tmp) / "outn", cores)
        rows.append(_row(f"job-{cores}", f"loongforge preprocess, {cores} worker processes (start-up included)",
                         frames, t_jobn, cores, base))
    for row in rows:
        row["dataset"] = (f"{spec['episodes']} episodes x 2 cameras x {spec['frames'][0]} frames, "
                          f"{spec['height']}x{spec['width']} H.264, GOP {spec['gop']}")
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"| {'row':<16} | {'frames':>6} | {'seconds':>8} | {'procs':>5} | {'frames/s':>9} | {'per core':>9} | " \
           f"{'vs decode+nv12':>14} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        ratio = f"{r['vs_decode_nv12']:.2f}x" if r["vs_decode_nv12"] is not None else "-"
        lines.append(f"| {r['id']:<16} | {r['frames']:>6} | {r['seconds']:>8.3f} | {r['processes']:>5} | "
                     f"{r['frames_per_s']:>9.1f} | {r['per_core']:>9.1f} | {ratio:>14} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="128x128, 4 episodes (about a minute)")


def handle(args: argparse.Namespace) -> int:
    rows = run(args.quick)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"dataset: {rows[0]['dataset']}; cores: {os.cpu_count()}; load average after: {load}")
    print(format_table(rows))
    return 0
