"""`PreprocessConfig`: every knob of the preprocess job, validated once at load.

Only the fields in `OUTPUT_FIELDS` change the bytes written; they are recorded
as the index's `params` (so two runs with the same values are byte-identical
and a trainer can check what windowing made its shards). Worker count and
runner choice never change the output and are therefore left out.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields

from loongforge.shared.errors import ConfigError
from loongforge.shared.split import parse_val_spec
from loongforge.shared.units import parse_size

# Exit codes of `loongforge preprocess` and of the pipeline module (README "Exit codes"): 0 done;
# 1 error, nothing published (LoongForgeError: bad config, unreadable dataset, disk full); 2 usage
# error (argparse); 3 done and published, but more records failed than --allow-failed permits.
EXIT_FAILED_RECORDS = 3
RESIZE_MODES = ("resize", "crop")
OUTPUT_FIELDS = ("frames_per_sample", "stride", "frame_step", "action_horizon", "min_frames", "height", "width",
                 "resize_mode", "shard_size", "zstd_level",
                 "color_range", "color_matrix")
FINGERPRINT_MODES = ("stat", "content")  # stat: size + mtime of every input file; content: their sha256
COLOR_RANGE_CHOICES = ("auto", "limited", "full")  # auto: keep the sources' range, refuse if they disagree
COLOR_MATRIX_CHOICES = ("auto", "bt601", "bt709")
FORMAT_VERSIONS = (1, 2)  # shared/FORMAT.md; 2 = frame blocks + mmap'd tables (issue 12)
DEFAULT_BLOCK_FRAMES = 16  # = shared.writer_v2.DEFAULT_BLOCK_FRAMES (not imported: config stays light)
BLOCK_CODEC_CHOICES = ("zstd", "delta-zstd")  # = shared.blocks.BLOCK_CODECS (FORMAT.md "Block codec")


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
    min_frames: int | None = None  # shortest tail window kept (< K makes frame counts vary); None = min(2, K)
    height: int | None = None  # None = source resolution
    width: int | None = None
    resize_mode: str = "resize"
    shard_size: int = 64 << 20
    zstd_level: int = 3
    workers: int = 0  # 0 = one per core
    val_episodes: str = ""  # validation split: "10%" or "3,7" (shared/split.py); "" = no split
    allow_failed: str = "0"  # failed records accepted before the exit code says failure: "N" or "P%" of episodes
    fingerprint: str = "stat"  # how source.fingerprint covers the input files (FINGERPRINT_MODES)
    color_range: str = "auto"  # output range; anything but "auto" converts every stream to it
    color_matrix: str = "auto"  # output matrix; anything but "auto" converts every stream to it
    progress_s: float = 10.0  # local runner: a progress line every this many seconds (0 = off)
    # Shard format written: 2 (default) = every frame once in zstd blocks of `block_frames` frames, samples derived
    # by the loader (FORMAT.md "Version 2"); 1 = per-sample windows (still written for v1 tooling and comparisons).
    format_version: int = 2
    block_frames: int = DEFAULT_BLOCK_FRAMES  # B, frames per block (format 2 only)
    block_codec: str = "zstd"  # format 2: block codec before zstd (FORMAT.md; delta-zstd: 11-23 % smaller)

    def __post_init__(self):
        if self.min_frames is None:  # K=1 (one frame per sample) must work without a flag
            object.__setattr__(self, "min_frames", min(2, self.frames_per_sample)
                               if isinstance(self.frames_per_sample, int) else 2)
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
        parse_val_spec(self.val_episodes)  # raises ConfigError on a bad spec, before any work
        self.failed_allowed(1)  # validates allow_failed
        if self.fingerprint not in FINGERPRINT_MODES:
            raise ConfigError(f"fingerprint={self.fingerprint!r}: choose one of {FINGERPRINT_MODES}")
        if self.color_range not in COLOR_RANGE_CHOICES:
            raise ConfigError(f"color_range={self.color_range!r}: choose one of {COLOR_RANGE_CHOICES}")
        if self.color_matrix not in COLOR_MATRIX_CHOICES:
            raise ConfigError(f"color_matrix={self.color_matrix!r}: choose one of {COLOR_MATRIX_CHOICES}")
        if self.format_version not in FORMAT_VERSIONS:
            raise ConfigError(f"format_version={self.format_version!r}: choose one of {FORMAT_VERSIONS}")
        if not isinstance(self.block_frames, int) or self.block_frames < 1:
            raise ConfigError(f"block_frames={self.block_frames!r}: must be an integer >= 1 (e.g. "
                              f"{DEFAULT_BLOCK_FRAMES})")
        if self.block_codec not in BLOCK_CODEC_CHOICES:
            raise ConfigError(f"block_codec={self.block_codec!r}: choose one of {BLOCK_CODEC_CHOICES}")
        if self.block_codec != "zstd" and self.format_version == 1:
            raise ConfigError(f"block_codec={self.block_codec!r} is a format-2 option: drop --block-codec or "
                              "write format 2")
        if self.progress_s < 0:
            raise ConfigError(f"progress_s={self.progress_s}: must be >= 0 (0 = no progress lines)")
        if not self.input or not self.output:
            raise ConfigError("input and output: both are required (--input DATASET --output SHARDS)")
        if self.output.rstrip("/") == self.input.rstrip("/"):
            raise ConfigError("output must differ from input: the job would write into the source dataset")

    @property
    def num_workers(self) -> int:
        return self.workers or default_workers()

    def failed_allowed(self, episodes: int) -> int:
        """How many failed records still count as success, for a job over `episodes` episodes."""
        text = str(self.allow_failed).strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
        if m and float(m.group(1)) <= 100:
            return int(float(m.group(1)) / 100 * episodes)  # floor: 5% of 10 episodes allows 0
        if text.isdigit():
            return int(text)
        raise ConfigError(f"allow_failed={self.allow_failed!r}: give a count N (e.g. 3) or a percentage of "
                          "episodes P% (e.g. 5%), at most 100%")

    def output_params(self) -> dict:
        out = {name: getattr(self, name) for name in OUTPUT_FIELDS}
        if self.format_version != 1:  # v1 params keep their bytes (and v1 indexes stay byte-identical)
            out.update(format_version=self.format_version, block_frames=self.block_frames)
            if self.block_codec != "zstd":  # absent = zstd: default roots keep the params they had before codecs
                out["block_codec"] = self.block_codec
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="LeRobot v2 dataset root (path or URL)")
    parser.add_argument("--output", required=True, help="shard root to write (path or URL)")
    parser.add_argument("--frames-per-sample", type=int, default=4, metavar="K", help="format 1: frames per window (4)")
    parser.add_argument("--stride", type=int, default=4, metavar="S", help="format 1: frames between window starts (4)")
    parser.add_argument("--frame-step", type=int, default=1, metavar="D",
                        help="format 1: frames between window frames (1)")
    parser.add_argument("--action-horizon", type=int, default=16, metavar="H", help="action rows per sample (16)")
    parser.add_argument("--min-frames", type=int, default=None, metavar="M",
                        help="format 1: shortest tail window kept (default min(2, K))")
    parser.add_argument("--height", type=int, default=None, help="output height (default: source)")
    parser.add_argument("--width", type=int, default=None, help="output width (default: source)")
    parser.add_argument("--resize-mode", choices=("resize", "crop"), default="resize",
                        help="resize: scale to HxW; crop: centre-crop to the aspect, then scale")
    parser.add_argument("--shard-size", default="64MiB", help="target shard size, e.g. 64MiB, 1GB (SI units are powers of 1000, IEC powers of 1024; default 64MiB)")
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd level of NV12 payloads (3)")
    parser.add_argument("--workers", type=int, default=0, help="local worker processes (0 = one per core)")
    parser.add_argument("--val-episodes", default="", metavar="SPEC",
                        help="hold out episodes for validation: a percentage (10%%) or ids (3,7); default none")
    parser.add_argument("--allow-failed", default="0", metavar="N|P%",
                        help="failed records (episodes) tolerated before the exit code is 3: a count or a "
                        "percentage of episodes, e.g. 2 or 5%% (default 0)")
    parser.add_argument("--fingerprint", choices=FINGERPRINT_MODES, default="stat",
                        help="source.fingerprint over every input file's size+mtime (stat, default) or its "
                        "content hash (content: reads every byte once more)")
    parser.add_argument("--color-range", choices=COLOR_RANGE_CHOICES, default="auto",
                        help="auto: keep the sources' range (refuse if cameras disagree); limited|full: convert "
                        "every stream to it")
    parser.add_argument("--color-matrix", choices=COLOR_MATRIX_CHOICES, default="auto",
                        help="auto: keep the sources' matrix (refuse if cameras disagree); bt601|bt709: convert")
    parser.add_argument("--format-version", type=int, choices=FORMAT_VERSIONS, default=2,
                        help="shard format: 2 frame blocks + memory-mapped index (default; every timestep a sample; "
                        "shared/FORMAT.md), 1 per-sample windows (v1 readers; `loongforge convert` rewrites 1 as 2)")
    parser.add_argument("--block-frames", type=int, default=DEFAULT_BLOCK_FRAMES, metavar="B",
                        help=f"format 2: consecutive frames per zstd block ({DEFAULT_BLOCK_FRAMES})")
    parser.add_argument("--block-codec", choices=BLOCK_CODEC_CHOICES, default="zstd",
                        help="format 2: zstd (default) or delta-zstd (frame-to-frame differences, lossless, 11-23%% "
                        "smaller on synthetic footage at the same decode CPU; shared/FORMAT.md)")
    parser.add_argument("--progress-s", type=float, default=10.0, metavar="S",
                        help="local runner: a progress line every S seconds (0 = off; 10)")


# Window flags of format 1 and their defaults: format 2 stores every frame and derives samples at
# training time (train --video-deltas/--sample-stride), so a changed window flag would be ignored.
V1_WINDOW_FLAGS = {"frames_per_sample": 4, "stride": 4, "frame_step": 1, "min_frames": None}


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    if getattr(args, "format_version", 2) == 2:
        changed = [n for n, d in V1_WINDOW_FLAGS.items() if getattr(args, n, d) != d]
        if changed:
            flags = ", ".join("--" + n.replace("_", "-") for n in changed)
            raise ConfigError(f"{flags}: window flags of format 1, which format 2 (the default) does not use: "
                              "every timestep is a sample, shaped at training time (--video-deltas, "
                              "--sample-stride); drop them, or add --format-version 1 for per-sample windows")
    return PreprocessConfig(input=args.input, output=args.output, frames_per_sample=args.frames_per_sample,
                            stride=args.stride, frame_step=args.frame_step, action_horizon=args.action_horizon,
                            min_frames=args.min_frames, height=args.height, width=args.width,
                            resize_mode=args.resize_mode, shard_size=parse_size(args.shard_size, "--shard-size"),
                            zstd_level=args.zstd_level, workers=args.workers,
                            val_episodes=getattr(args, "val_episodes", "") or "",
                            allow_failed=args.allow_failed, fingerprint=args.fingerprint,
                            color_range=args.color_range, color_matrix=args.color_matrix,
                            progress_s=args.progress_s,
                            format_version=getattr(args, "format_version", 2),
                            block_frames=getattr(args, "block_frames", DEFAULT_BLOCK_FRAMES),
                            block_codec=getattr(args, "block_codec", "zstd"))
