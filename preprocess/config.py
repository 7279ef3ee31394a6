"""`PreprocessConfig`: every knob of the preprocess job, validated once at load.

Only the fields in `OUTPUT_FIELDS` change the bytes written; they are recorded
as the index's `params` (so two runs with the same values are byte-identical).
Worker count and runner choice never change the output and are therefore left out.

The job writes shard format 2 only (FORMAT.md). The flags of the retired format 1
(per-sample windows) are refused with one line that says how to convert a format-1
root, never silently ignored.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields

from loongforge.shared.errors import ConfigError
from loongforge.shared.split import check_val_options
from loongforge.shared.units import parse_size

# Exit codes of `loongforge preprocess` and of `python -m loongforge.preprocess.pipeline` (README
# "Exit codes"): 0 done; 1 error, nothing published (LoongForgeError: bad config, unreadable files,
# disk full); 2 usage error, found before any work (argparse; UsageError: a flag naming what the
# dataset lacks; UnsupportedSourceError: a LeRobot version not read, a meta/ file that is not JSON);
# 3 done and published, but more records failed than --allow-failed permits.
EXIT_FAILED_RECORDS = 3

RESIZE_MODES = ("resize", "crop")
OUTPUT_FIELDS = ("action_horizon", "height", "width", "resize_mode", "shard_size", "zstd_level", "color_range",
                 "color_matrix")
FINGERPRINT_MODES = ("stat", "content")  # stat: size + mtime of every input file; content: their sha256
COLOR_RANGE_CHOICES = ("auto", "limited", "full")  # auto: keep the sources' range, refuse if they disagree
COLOR_MATRIX_CHOICES = ("auto", "bt601", "bt709")
DEFAULT_BLOCK_FRAMES = 16  # = shared.writer.DEFAULT_BLOCK_FRAMES (not imported: config stays light)
BLOCK_CODEC_CHOICES = ("zstd", "delta-zstd")  # = shared.blocks.BLOCK_CODECS (FORMAT.md "Block codec")
FRAME_MISMATCH_CHOICES = ("clamp", "skip", "fail")  # = stages.timing.MISMATCH_POLICIES
DEFAULT_TIMESTAMP_TOLERANCE_S = 1e-4  # LeRobotDataset's tolerance_s


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PreprocessConfig:
    input: str
    output: str
    action_horizon: int = 16  # H recorded for loaders (`train --action-horizon 0` takes it)
    height: int | None = None  # None = source resolution
    width: int | None = None
    resize_mode: str = "resize"
    shard_size: int = 64 << 20
    zstd_level: int = 3
    workers: int = 0  # 0 = one per core
    val_episodes: str = ""  # validation split: episode ids "3,7" or a percentage "10%" (shared/split.py); "" = none
    val_count: int = 0  # validation split: this many episodes, picked deterministically; 0 = none
    val_fraction: float = 0.0  # validation split: this fraction of the episodes; 0 = none
    allow_failed: str = "0"  # failed records accepted before the exit code says failure: "N" or "P%" of episodes
    fingerprint: str = "stat"  # how source.fingerprint covers the input files (FINGERPRINT_MODES)
    color_range: str = "auto"  # output range; anything but "auto" converts every stream to it
    color_matrix: str = "auto"  # output matrix; anything but "auto" converts every stream to it
    progress_s: float = 10.0  # local runner: a progress line every this many seconds (0 = off)
    # Every frame is stored once, in zstd blocks of `block_frames` frames; samples are derived by the loader.
    block_frames: int = DEFAULT_BLOCK_FRAMES  # B, frames per block
    block_codec: str = "zstd"  # block codec before zstd (FORMAT.md; delta-zstd: 11-23 % smaller)
    # Row r shows the frame nearest its timestamp (stages/timing.py); a row with none within the
    # tolerance is clamped to the nearest frame of its episode, skipped, or fails the episode.
    timestamp_tolerance_s: float = DEFAULT_TIMESTAMP_TOLERANCE_S
    frame_mismatch: str = "clamp"
    # The GR00T N1.6 embodiment the data trains (shared/embodiment.py): a registered tag, or any tag with the
    # user's modality config file; "" = new_embodiment with a config derived from the dataset's modality.json.
    embodiment_tag: str = ""
    modality_config: str = ""

    def __post_init__(self):
        if not isinstance(self.action_horizon, int) or self.action_horizon < 1:
            raise ConfigError(f"action_horizon={self.action_horizon!r}: must be an integer >= 1")
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
        check_val_options(self.val_episodes, self.val_count, self.val_fraction)  # ConfigError before any work
        self.failed_allowed(1)  # validates allow_failed
        if self.fingerprint not in FINGERPRINT_MODES:
            raise ConfigError(f"fingerprint={self.fingerprint!r}: choose one of {FINGERPRINT_MODES}")
        if self.color_range not in COLOR_RANGE_CHOICES:
            raise ConfigError(f"color_range={self.color_range!r}: choose one of {COLOR_RANGE_CHOICES}")
        if self.color_matrix not in COLOR_MATRIX_CHOICES:
            raise ConfigError(f"color_matrix={self.color_matrix!r}: choose one of {COLOR_MATRIX_CHOICES}")
        if not isinstance(self.block_frames, int) or self.block_frames < 1:
            raise ConfigError(f"block_frames={self.block_frames!r}: must be an integer >= 1 (e.g. "
                              f"{DEFAULT_BLOCK_FRAMES})")
        if self.block_codec not in BLOCK_CODEC_CHOICES:
            raise ConfigError(f"block_codec={self.block_codec!r}: choose one of {BLOCK_CODEC_CHOICES}")
        if not self.timestamp_tolerance_s > 0:
            raise ConfigError(f"timestamp_tolerance_s={self.timestamp_tolerance_s!r}: must be > 0 seconds (LeRobot's "
                              f"default is {DEFAULT_TIMESTAMP_TOLERANCE_S:g})")
        if self.frame_mismatch not in FRAME_MISMATCH_CHOICES:
            raise ConfigError(f"frame_mismatch={self.frame_mismatch!r}: choose one of {FRAME_MISMATCH_CHOICES}")
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
        if self.block_codec != "zstd":  # absent = zstd: default roots keep the params they had before codecs
            out["block_codec"] = self.block_codec
        # Absent = the defaults (source.frame_timing records what was applied either way).
        if self.timestamp_tolerance_s != DEFAULT_TIMESTAMP_TOLERANCE_S:
            out["timestamp_tolerance_s"] = self.timestamp_tolerance_s
        if self.frame_mismatch != "clamp":
            out["frame_mismatch"] = self.frame_mismatch
        if self.embodiment_tag:  # absent = the derived config (dataset.embodiment records what was used)
            out["embodiment_tag"] = self.embodiment_tag
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# Flags of format 1 (per-sample windows): format 2 stores every frame and shapes samples at training time.
RETIRED_FLAGS = ("--format-version", "--frames-per-sample", "--stride", "--frame-step", "--min-frames")
RETIRED = ("shard format 1 (per-sample windows) is retired: preprocess writes format 2, where every timestep is a "
           "sample shaped at training time (`loongforge train --video-deltas`, `--sample-stride`); drop the flag, and "
           "rewrite an existing format-1 root with `loongforge convert ROOT --to v2 OUT`")


class _RetiredFlag(argparse.Action):
    """Refuses a format-1 flag with one line (exit 2, a usage error), whatever its value."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string}: {RETIRED}\n")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="LeRobot dataset root, v2.0, v2.1 or v3.0 (path or URL)")
    parser.add_argument("--output", required=True, help="shard root to write (path or URL)")
    parser.add_argument("--action-horizon", type=int, default=16, metavar="H",
                        help="action rows per sample recorded for loaders (train --action-horizon overrides; 16)")
    parser.add_argument("--height", type=int, default=None, help="output height (default: source)")
    parser.add_argument("--width", type=int, default=None, help="output width (default: source)")
    parser.add_argument("--resize-mode", choices=("resize", "crop"), default="resize",
                        help="resize: scale to HxW; crop: centre-crop to the aspect, then scale")
    parser.add_argument("--shard-size", default="64MiB", help="target shard size, e.g. 64MiB, 1GB (SI units are powers of 1000, IEC powers of 1024; default 64MiB)")
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd level of NV12 payloads (3)")
    parser.add_argument("--workers", type=int, default=0, help="local worker processes (0 = one per core)")
    parser.add_argument("--val-episodes", default="", metavar="IDS",
                        help="hold out these episode ids for validation (3,7: ids, not a count), or a percentage "
                        "(10%%); checked against the dataset before any work; default none")
    parser.add_argument("--val-count", type=int, default=0, metavar="N",
                        help="hold out N episodes for validation, picked deterministically (default 0: none)")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                        help="hold out this fraction of the episodes for validation, e.g. 0.1 (default 0: none)")
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
    parser.add_argument("--block-frames", type=int, default=DEFAULT_BLOCK_FRAMES, metavar="B",
                        help=f"consecutive frames per zstd block ({DEFAULT_BLOCK_FRAMES})")
    parser.add_argument("--block-codec", choices=BLOCK_CODEC_CHOICES, default="zstd",
                        help="zstd (default) or delta-zstd (frame-to-frame differences, lossless, 11-23%% smaller "
                        "on synthetic footage at the same decode CPU; shared/FORMAT.md)")
    parser.add_argument("--timestamp-tolerance", type=float, default=DEFAULT_TIMESTAMP_TOLERANCE_S, metavar="S",
                        help="row r shows the video frame nearest its timestamp, as LeRobot decodes it; a row with "
                        "no frame within S seconds is a mismatch (default 1e-4, LeRobot's tolerance_s)")
    parser.add_argument("--frame-mismatch", choices=FRAME_MISMATCH_CHOICES, default="clamp",
                        help="a row with no frame within the tolerance: clamp to the nearest frame of its episode "
                        "(default), skip the row, or fail the episode; counted per camera in the summary and index")
    parser.add_argument("--embodiment-tag", default="", metavar="TAG",
                        help="GR00T N1.6 embodiment of the data: a registered tag (oxe_droid, unitree_g1, libero_panda, "
                        "oxe_widowx, oxe_google, behavior_r1_pro) takes its modality config; any tag with "
                        "--modality-config; default: new_embodiment with a config derived from meta/modality.json "
                        "(every key absolute, min/max)")
    parser.add_argument("--modality-config", default="", metavar="FILE",
                        help="the embodiment's modality config: Isaac-GR00T's JSON form (.json) or Python form (.py, "
                        "as its --modality_config_path; read, never run)")
    parser.add_argument("--progress-s", type=float, default=10.0, metavar="S",
                        help="local runner: a progress line every S seconds (0 = off; 10)")
    for flag in RETIRED_FLAGS:
        parser.add_argument(flag, action=_RetiredFlag)


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(input=args.input, output=args.output, action_horizon=args.action_horizon,
                            height=args.height, width=args.width,
                            resize_mode=args.resize_mode, shard_size=parse_size(args.shard_size, "--shard-size"),
                            zstd_level=args.zstd_level, workers=args.workers,
                            val_episodes=getattr(args, "val_episodes", "") or "",
                            val_count=getattr(args, "val_count", 0) or 0,
                            val_fraction=getattr(args, "val_fraction", 0.0) or 0.0,
                            allow_failed=args.allow_failed, fingerprint=args.fingerprint,
                            color_range=args.color_range, color_matrix=args.color_matrix,
                            progress_s=args.progress_s, block_frames=args.block_frames,
                            block_codec=args.block_codec,
                            timestamp_tolerance_s=getattr(args, "timestamp_tolerance", DEFAULT_TIMESTAMP_TOLERANCE_S),
                            frame_mismatch=getattr(args, "frame_mismatch", "clamp"),
                            embodiment_tag=getattr(args, "embodiment_tag", "") or "",
                            modality_config=getattr(args, "modality_config", "") or "")
