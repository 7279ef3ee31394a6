"""`loongforge preprocess | inspect | sample-data`.

Beam, PyAV and pyarrow are imported inside the handlers: `loongforge --help`
stays fast and works on nodes without the preprocess extra.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from loongforge.preprocess.config import EXIT_FAILED_RECORDS

QUIRK_CHOICES = ("missing_camera", "splits_beyond", "total_chunks_zero", "corrupt_video", "length_mismatch")


def register(subparsers) -> None:
    p = subparsers.add_parser("preprocess", help="convert a LeRobot dataset to NV12 shards (Apache Beam)",
                              description="Convert a LeRobot dataset (v2.0, v2.1 or v3.0; video or image features) "
                              "into NV12 shards "
                              "and a global index. Beam options go after `--`, e.g. `-- --direct_running_mode="
                              "in_memory` or `--runner dataflow -- --project=P --region=R` (every runner: README "
                              "'Preprocess at scale').")
    from loongforge.preprocess.config import add_job_arguments
    from loongforge.preprocess.runner.choice import add_runner_arguments

    add_job_arguments(p)
    add_runner_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    # The top-level parser rejects unknown flags, so Beam's own options go after
    # a `--`: loongforge preprocess --input D --output S -- --project=P --region=R
    p.add_argument("beam_args", nargs=argparse.REMAINDER, metavar="-- BEAM_OPTIONS",
                   help="Beam pipeline options after `--`, passed through unchanged")
    p.set_defaults(func=_preprocess)

    c = subparsers.add_parser("convert", help="rewrite a root of the retired format 1 as format 2",
                              description="Rewrite a format-1 shard root (per-sample windows, retired) as format 2 "
                              "(frame blocks + memory-mapped index, shared/FORMAT.md), the only format LoongForge "
                              "reads. No Beam, no source video needed.")
    c.add_argument("root", metavar="ROOT", help="format-1 shard root (path or URL)")
    c.add_argument("--to", choices=("v2",), required=True, help="target format (v2)")
    c.add_argument("out", metavar="OUT", help="shard root to write")
    c.add_argument("--block-frames", type=int, default=16, metavar="B", help="frames per zstd block (16)")
    c.add_argument("--block-codec", choices=("zstd", "delta-zstd"), default="zstd",
                   help="zstd (default) or delta-zstd (frame-to-frame differences; shared/FORMAT.md)")
    c.add_argument("--zstd-level", type=int, default=3)
    c.add_argument("--shard-size", default="64MiB", help="target shard size (64MiB)")
    c.add_argument("--strict", action="store_true",
                   help="refuse when actions are missing from the v1 root instead of filling them (action_known)")
    c.set_defaults(func=_convert)

    s = subparsers.add_parser("sample-data",
                              help="generate a LeRobot sample dataset (v2.0/v2.1/v3.0, real video via PyAV)")
    s.add_argument("out", metavar="OUT", help="directory to create")
    s.add_argument("--preset", choices=("default", "gr00t-like", "oxe-droid"), default="default",
                   help="gr00t-like: 256x256, 20 fps, one ego_view camera, 44-D state/action, metadata quirks; "
                   "oxe-droid: N1.6's registered oxe_droid keys (two cameras, joint_position + gripper_position, "
                   "preprocess with --embodiment-tag oxe_droid)")
    s.add_argument("--episodes", type=int, default=None, help="episodes (3)")
    s.add_argument("--frames", type=int, nargs=2, metavar=("A", "B"), default=None,
                   help="frames per episode, drawn from [A, B] (40 60)")
    s.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), default=None, help="frame size (64 64)")
    s.add_argument("--fps", type=int, default=None)
    s.add_argument("--cameras", nargs="+", default=None, help="camera names (ego_view wrist_view)")
    s.add_argument("--state-dim", type=int, default=None)
    s.add_argument("--action-dim", type=int, default=None)
    s.add_argument("--gop", type=int, default=None, help="H.264 keyframe interval (10; use >= 100 for benchmarks)")
    s.add_argument("--crf", type=int, default=None, help="x264 quality (23)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--quirks", nargs="*", choices=QUIRK_CHOICES, default=None,
                   help="inject real-world defects into the dataset")
    s.add_argument("--task", choices=("default", "learnable", "hands"), default=None,
                   help="learnable: actions are an exact function of state and frame content (for eval checks); "
                   "hands: learnable plus binary hand/gripper commands (+-1.5/+-3) the frames announce")
    s.add_argument("--footage", choices=("grain", "camera"), default=None,
                   help="grain (default): scrolling noise texture, worst case for storing frames; "
                        "camera: a fixed robot camera model (static scene, moving arm, sensor noise)")
    s.add_argument("--lerobot-version", choices=("v2.0", "v2.1", "v3.0"), default="v2.0",
                   help="layout to write: v2.0 (default), v2.1 (+ episodes_stats.jsonl) or v3.0 (LeRobot >= 0.4: "
                        "episodes concatenated per file, re-encoded with --codec at --gop, default 2)")
    s.add_argument("--codec", choices=("h264", "hevc", "av1"), default="av1",
                   help="v3.0 only: the re-encoding codec (av1, LeRobot's default)")
    s.add_argument("--episodes-per-file", type=int, default=0, metavar="N",
                   help="v3.0 only: episodes per data/video file (0: all in one)")
    s.add_argument("--sim", default=None, metavar="metaworld:TASK",
                   help="demonstrations from a simulator instead: the task's scripted expert on seeded resets "
                   "(--seed: the first), successful episodes only, as LeRobot v3.0 with H.264 video of one camera at "
                   "--size (default 84: the tiny-sim recipe's image edge); needs the [sim] extra (make setup)")
    s.add_argument("--camera", default=None, help="--sim: the camera rendered (default corner2)")
    s.set_defaults(func=_sample_data)


class _BeamOptionalNotice(logging.Filter):
    """Beam's import says, on the root logger, that BigQuery's client libraries are missing: a connector
    a preprocess job never uses, and nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.getMessage().startswith("apitools not found"))


def _quiet_beam() -> None:
    # Beam logs every bundle at INFO, and the local job service re-logs each
    # worker record a second time; the progress line and the summary say what a user needs.
    logging.getLogger().addFilter(_BeamOptionalNotice())
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    # --runner dask: the cluster's own INFO lines (dask reads its logging config from the environment on import,
    # which also reaches a local cluster's worker processes); a user's own setting wins
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


def _preprocess(args: argparse.Namespace) -> int:
    _quiet_beam()  # before Beam is imported: its import logs
    from loongforge.preprocess.config import config_from_args
    from loongforge.preprocess.pipeline import run_job
    from loongforge.shared.summary import format_summary
    from loongforge.preprocess.runner.choice import runner_from_args

    cfg = config_from_args(args)
    runner, beam_args = runner_from_args(args, [a for a in args.beam_args if a != "--"])
    summary = run_job(cfg, beam_args, runner)
    allowed = cfg.failed_allowed(summary["input_episodes"])
    summary["failed_allowed"] = allowed
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(summary))
    if summary["failed"] > allowed:
        print(f"loongforge preprocess: {summary['failed']} record(s) failed, {allowed} allowed (--allow-failed "
              f"{cfg.allow_failed}): exit {EXIT_FAILED_RECORDS}. The shards and index of the rest are written; "
              "failed.jsonl lists what failed", file=sys.stderr)
        return EXIT_FAILED_RECORDS
    return 0


def _convert(args: argparse.Namespace) -> int:
    from loongforge.shared.legacy import convert_root
    from loongforge.shared.errors import ConfigError
    from loongforge.shared.units import parse_size

    if args.out.rstrip("/") == args.root.rstrip("/"):
        raise ConfigError("OUT must differ from ROOT: the converter reads ROOT while it writes")
    if args.block_frames < 1:
        raise ConfigError(f"--block-frames {args.block_frames}: must be >= 1")
    summary = convert_root(args.root, args.out, block_size=args.block_frames, zstd_level=args.zstd_level,
                          block_codec=args.block_codec,
                          shard_size=parse_size(args.shard_size, "--shard-size"), strict=args.strict)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _sample_data(args: argparse.Namespace) -> int:
    if args.sim:
        return _sim_demos(args)
    from loongforge.preprocess.samples.dataset import generate_preset

    given = {"episodes": args.episodes, "frames": tuple(args.frames) if args.frames else None,
             "height": args.size[0] if args.size else None, "width": args.size[1] if args.size else None,
             "fps": args.fps, "cameras": tuple(args.cameras) if args.cameras else None,
             "state_dim": args.state_dim, "action_dim": args.action_dim, "gop": args.gop, "crf": args.crf,
             "seed": args.seed, "quirks": tuple(args.quirks) if args.quirks is not None else None,
             "task": args.task, "footage": args.footage}
    version = args.lerobot_version
    if version == "v3.0":
        import tempfile

        from loongforge.preprocess.samples.layouts import write_v3

        given["gop"] = given["gop"] or 2  # LeRobot's encoder default
        with tempfile.TemporaryDirectory(prefix="lf-sample-v2-") as tmp:
            v2 = generate_preset(f"{tmp}/v2", args.preset, **{k: v for k, v in given.items() if v is not None})
            root = write_v3(v2, args.out, codec=args.codec, gop=given["gop"], episodes_per_file=args.episodes_per_file)
    else:
        root = generate_preset(args.out, args.preset, **{k: v for k, v in given.items() if v is not None})
        if version == "v2.1":
            from loongforge.preprocess.samples.layouts import write_v21

            write_v21(root)
    print(f"wrote LeRobot {version} dataset ({args.preset}) to {root}", file=sys.stderr)
    return 0


def _sim_demos(args: argparse.Namespace) -> int:
    from loongforge.preprocess.samples.sim_demos import write_demos
    from loongforge.preprocess.samples.sim_env import DEFAULT_CAMERA, DEFAULT_SIZE
    from loongforge.shared.errors import UsageError

    if args.lerobot_version == "v2.1":
        raise UsageError("--sim writes LeRobot v3.0; --lerobot-version v2.1 is not offered")
    if args.size and args.size[0] != args.size[1]:
        raise UsageError(f"--size {args.size[0]} {args.size[1]}: --sim renders square frames")
    summary = write_demos(args.out, args.sim, episodes=args.episodes or 3, size=args.size[0] if args.size else
                          DEFAULT_SIZE, camera=args.camera or DEFAULT_CAMERA, seed=args.seed or 0,
                          crf=args.crf if args.crf is not None else 18,
                          log=lambda line: print(line, file=sys.stderr))
    print(f"wrote LeRobot v3.0 dataset of {summary['episodes']} expert episode(s) of {summary['env']} to {args.out}: "
          f"{summary['failed']} failed and left out (seeds {summary['failed_seeds']}); {sum(summary['steps'])} "
          f"frames; rendering {summary['render_frames_per_s']} frames/s, {summary['env_steps_per_s']} env steps/s "
          f"in all", file=sys.stderr)
    return 0
