"""`PreprocessConfig`: every knob of the preprocess job, validated once at load.

Only the fields in `OUTPUT_FIELDS` change the bytes written; they are recorded
as the index's `params` (so two runs with the same values are byte-identical
and a trainer can check what windowing made its shards). Worker count and
runner choice never change the output and are therefore left out.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from loongforge.shared.errors import ConfigError
from loongforge.shared.units import parse_size

RESIZE_MODES = ("resize", "crop")
OUTPUT_FIELDS = ("frames_per_sample", "stride", "frame_step", "action_horizon", "min_frames", "height", "width",
                 "resize_mode", "shard_size", "zstd_level")


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PreprocessConfig:
    input: str
    output: str
    frames_per_sample: int = 4  # K
    stride: int = 4  # first frames of consecutive windows are `stride` frames apart
    frame_step: int = 1  # D: frames inside a window are D source frames apart
    action_horizon: int = 16  # H action rows from the window's last frame
    min_frames: int = 2  # shortest tail window kept (< K makes frame counts vary)
    height: int | None = None  # None = source resolution
    width: int | None = None
    resize_mode: str = "resize"
    shard_size: int = 64 << 20
    zstd_level: int = 3
    workers: int = 0  # 0 = one per core
    val_episodes: str = ""  # validation split: "10%" or "3,7" (shared/split.py); "" = no split

    def __post_init__(self):
        for name in ("frames_per_sample", "stride", "frame_step", "action_horizon", "min_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        if self.min_frames > self.frames_per_sample:
            raise ConfigError(f"min_frames={self.min_frames} > frames_per_sample={self.frames_per_sample}: "
                              "set --min-frames to at most --frames-per-sample")
        if (self.height is None) != (self.width is None):
            raise ConfigError("height and width: give both (--height H --width W) or neither (source resolution)")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (value <= 0 or value % 2):
                raise ConfigError(f"{name}={value}: NV12 needs a positive even size, e.g. {max(2, value + value % 2)}")
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(f"resize_mode={self.resize_mode!r}: choose one of {RESIZE_MODES}")
        if self.shard_size < 1 << 16:
            raise ConfigError(f"shard_size={self.shard_size}: must be at least 64KiB")
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level={self.zstd_level}: must be in 1..22")
        if self.workers < 0:
            raise ConfigError(f"workers={self.workers}: must be >= 0 (0 = one per core)")
        from loongforge.shared.split import parse_val_spec

        parse_val_spec(self.val_episodes)  # raises ConfigError on a bad spec, before any work
        if not self.input or not self.output:
            raise ConfigError("input and output: both are required (--input DATASET --output SHARDS)")
        if self.output.rstrip("/") == self.input.rstrip("/"):
            raise ConfigError("output must differ from input: the job would write into the source dataset")

    @property
    def num_workers(self) -> int:
        return self.workers or default_workers()

    def output_params(self) -> dict:
        return {name: getattr(self, name) for name in OUTPUT_FIELDS}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="LeRobot v2 dataset root (path or URL)")
    parser.add_argument("--output", required=True, help="shard root to write (path or URL)")
    parser.add_argument("--frames-per-sample", type=int, default=4, metavar="K", help="frames per window (4)")
    parser.add_argument("--stride", type=int, default=4, metavar="S", help="frames between window starts (4)")
    parser.add_argument("--frame-step", type=int, default=1, metavar="D", help="frames between window frames (1)")
    parser.add_argument("--action-horizon", type=int, default=16, metavar="H", help="action rows per sample (16)")
    parser.add_argument("--min-frames", type=int, default=2, metavar="M", help="shortest tail window kept (2)")
    parser.add_argument("--height", type=int, default=None, help="output height (default: source)")
    parser.add_argument("--width", type=int, default=None, help="output width (default: source)")
    parser.add_argument("--resize-mode", choices=("resize", "crop"), default="resize",
                        help="resize: scale to HxW; crop: centre-crop to the aspect, then scale")
    parser.add_argument("--shard-size", default="64MiB", help="target shard size, e.g. 64MiB, 1GB (SI units are powers of 1000, IEC powers of 1024; default 64MiB)")
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd level of NV12 payloads (3)")
    parser.add_argument("--workers", type=int, default=0, help="local worker processes (0 = one per core)")
    parser.add_argument("--val-episodes", default="", metavar="SPEC",
                        help="hold out episodes for validation: a percentage (10%%) or ids (3,7); default none")


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(input=args.input, output=args.output, frames_per_sample=args.frames_per_sample,
                            stride=args.stride, frame_step=args.frame_step, action_horizon=args.action_horizon,
                            min_frames=args.min_frames, height=args.height, width=args.width,
                            resize_mode=args.resize_mode, shard_size=parse_size(args.shard_size, "--shard-size"),
                            zstd_level=args.zstd_level, workers=args.workers,
                            val_episodes=getattr(args, "val_episodes", "") or "")
