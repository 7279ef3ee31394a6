"""Item-by-item parity of LoongForge's LeRobotDataset with the real lerobot 0.6.1.

    bash benchmarks/lerobot_venv/setup.sh /work/lerobot-venv          # once: lerobot in its own py3.12 venv
    loongforge bench lerobot-parity --lerobot-venv /work/lerobot-venv  # results/lerobot-parity.{md,json}

lerobot does not install beside LoongForge's pins, so its side runs in that venv
(benchmarks/lerobot_venv/dump_items.py: `LeRobotDataset(root, delta_timestamps=...,
video_backend="pyav")[i]` for every index, saved with the error where it raises); this side
preprocesses the same dataset (default options) and compares LoongForge's item for the same
index and `delta_timestamps`: keys, shapes, dtypes, values of every non-image key; images
bit-exact with `color="pyav"`, max / mean |difference| in /255 with the default colour.

Datasets: `--dataset ROOT` (your own v3.0 roots, repeatable), else the v3.0 fixtures written by
lerobot itself (../shared/fixtures/lerobot_v3, video and image, when present), and GR00T-like sample data in v3.0 (AV1, GOP 2) stamped from 1/fps (GR00T's
demo data) and with a robot's wall clock (jitter, dropped frames: H.264 at a variable frame rate).
Delta settings: none (the current frame), gr00t (each camera and the state at 0, 16 actions) and
history2 (2 frames of each camera and of the state, 16 actions from t-1).

Where lerobot is wrong LoongForge does the documented thing instead, and the table says so per
item: a row whose timestamp has no frame of its episode within 1e-4 s (an episode's last row
stamped from 1/fps, a dropped frame) makes lerobot raise FrameTimestampError or show the next
episode's first frame; LoongForge shows the nearest frame of the row's own episode (clamped,
counted by preprocess). Such items are counted apart ("lerobot raised", "images explained").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.preprocess.config import PreprocessConfig
from loongforge.preprocess.pipeline import run_job
from loongforge.preprocess.samples.dataset import generate_preset
from loongforge.preprocess.samples.layouts import shift_timestamps, wall_clock, write_v3
from loongforge.preprocess.stages.discover import discover
from loongforge.preprocess.stages.episode import read_table
from loongforge.shared.errors import UsageError
from loongforge.train.data.lerobot import LeRobotDataset

log = logging.getLogger(__name__)
SCRIPTS = Path(__file__).resolve().parents[1] / "lerobot_venv"
REPO = Path(__file__).resolve().parents[2]
IN_MEMORY = ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
TOLERANCE_S = 1e-4


def fixtures_dir() -> Path | None:
    """`<ancestor>/shared/fixtures/lerobot_v3` beside the checkout, as tests/outside.py finds it."""
    for parent in REPO.parents:
        found = parent / "shared" / "fixtures" / "lerobot_v3"
        if found.is_dir():
            return found
    return None


def build_datasets(work: Path, args) -> list[tuple[str, Path, dict | None]]:
    """(name, LeRobot v3.0 root, the fixture's own delta_timestamps or None): the --dataset roots as they
    are (read, never written), else the fixtures and the generated data."""
    if args.dataset:
        return [(f"{path} (--dataset)", Path(path), None) for path in args.dataset]
    out = []
    fixtures = fixtures_dir()
    for kind in ("video", "image") if fixtures else ():
        dest = work / f"fixture-{kind}"
        shutil.copytree(fixtures / kind, dest, copy_function=shutil.copyfile)
        for p in [dest, *dest.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        own = json.loads((fixtures / f"{kind}_items.json").read_text())["delta_timestamps"]
        out.append((f"fixture {kind} (lerobot's writer, {'AV1' if kind == 'video' else 'PNG'}, 2 cameras)", dest,
                    own))
    v2 = generate_preset(work / "v2", "gr00t-like", episodes=args.episodes, frames=tuple(args.frames),
                         height=args.size, width=args.size)
    gr00t = shift_timestamps(write_v3(v2, work / "gr00t", codec="av1", gop=2))
    out.append(("GR00T stamps from 1/fps (AV1 GOP 2)", gr00t, None))
    robot = write_v3(v2, work / "robot", codec="h264", gop=2, stamps=wall_clock(20, seed=1))
    out.append(("wall clock: jitter, dropped frames (H.264 VFR)", robot, None))
    return out


def delta_settings(meta, own: dict | None) -> dict[str, dict]:
    fps, cams = meta.fps, [c.key for c in meta.cameras]
    actions = [i / fps for i in range(16)]
    out = {"none": {}}
    if own:
        out["fixture's"] = own
    out["gr00t"] = {**{c: [0.0] for c in cams}, "observation.state": [0.0], "action": actions}
    out["history2"] = {**{c: [-1 / fps, 0.0] for c in cams}, "observation.state": [-1 / fps, 0.0],
                       "action": [(i - 1) / fps for i in range(16)]}
    return out


def lerobot_items(venv: str, root: Path, deltas: dict, out: Path) -> dict:
    cmd = [str(Path(venv) / "bin" / "python"), str(SCRIPTS / "dump_items.py"), "--root", str(root), "--out",
           str(out), "--deltas", json.dumps(deltas), "--tolerance-s", str(TOLERANCE_S)]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode:
        raise UsageError(f"lerobot in {venv} failed ({' '.join(cmd[:2])}): {run.stderr.strip()[-500:]}")
    z = np.load(out)
    items: dict[int, dict] = {int(i): {} for i in z["indices"]}
    for key in z.files:
        if key != "indices":
            i, name = key.split("/", 1)
            items[int(i)][name] = z[key]
    return items


def clamped_rows(src: Path) -> dict[str, set[int]]:
    """camera key -> dataset indices of the rows with no frame of their own episode within the tolerance."""
    import av

    meta, episodes = discover(str(src))
    out: dict[str, set[int]] = {c.key: set() for c in meta.cameras if c.kind == "video"}
    times: dict[str, np.ndarray] = {}
    first = 0
    for spec in episodes:
        ts = read_table(spec).column("timestamp").to_numpy().astype(np.float64)
        for (key, path), (start, end) in zip(spec.videos, spec.spans):
            if path not in times:
                with av.open(path) as c:
                    s = c.streams.video[0]
                    times[path] = np.sort([float(p.pts * s.time_base) for p in c.demux(s) if p.pts is not None])
            t = times[path]
            mine = t[(t >= start - 0.5 / meta.fps) & (t < end - 0.5 / meta.fps)]
            dist = np.abs((start + ts)[:, None] - mine[None, :]).min(1)
            out[key] |= set((first + np.flatnonzero(dist >= TOLERANCE_S)).tolist())
        first += len(ts)
    return out


def _rows(idx: int, deltas: list | None, fps: float, bounds: tuple[int, int]) -> list[int]:
    lo, hi = bounds
    return [min(max(idx + int(round(d * fps)), lo), hi - 1) for d in (deltas or [0.0])]


def compare(ours: LeRobotDataset, exact: LeRobotDataset, theirs: dict, deltas: dict, clamped: dict) -> dict:
    cams = set(ours.meta.camera_keys)
    to = ours.episode_data_index["to"].numpy()
    r = {"items": len(theirs), "lerobot_raised": 0, "raised_at_clamped_rows": 0, "key_sets_equal": 0,
         "values_equal": 0, "value_mismatches": {}, "images_bit_exact": 0, "images_explained": 0,
         "images_unexplained": 0, "image_max_255": 0.0, "image_sum": 0.0, "image_count": 0}
    for idx, want in sorted(theirs.items()):
        k = int(np.searchsorted(to, idx, side="right"))
        bounds = (int(to[k - 1]) if k else 0, int(to[k]))
        touched = any(row in clamped.get(c, ()) for c in cams for row in _rows(idx, deltas.get(c), ours.fps, bounds))
        if "__error__" in want:
            r["lerobot_raised"] += 1
            r["raised_at_clamped_rows"] += int(touched)
            continue
        got, got_exact = ours[idx], exact[idx]
        r["key_sets_equal"] += int(set(got) == set(want))
        bad = []
        for key, ref in want.items():
            if key not in got:
                bad.append(key)
            elif key == "task":
                bad += [] if got[key] == str(ref) else [key]
            elif key in cams:
                continue
            else:
                value = got[key].numpy()
                if value.dtype != ref.dtype or value.shape != ref.shape or not np.array_equal(value, ref):
                    bad.append(key)
        r["values_equal"] += int(not bad)
        for key in bad:
            r["value_mismatches"][key] = r["value_mismatches"].get(key, 0) + 1
        videos = [c for c in ours.meta.video_keys if c in want]  # image features: the colour rule, never exact
        if videos and all(np.array_equal(got_exact[c].numpy(), want[c]) for c in videos):
            r["images_bit_exact"] += 1
        elif videos:
            r["images_explained" if touched else "images_unexplained"] += 1
        if not touched:
            for c in cams & set(want):
                diff = np.abs(got[c].numpy() - want[c]) * 255
                r["image_max_255"] = max(r["image_max_255"], float(diff.max()))
                r["image_sum"] += float(diff.sum())
                r["image_count"] += diff.size
    r["image_mean_255"] = r.pop("image_sum") / max(1, r.pop("image_count"))
    return r


def run(args) -> list[dict]:
    rows = []
    if args.work:
        os.makedirs(args.work, exist_ok=True)  # a --work folder that does not exist yet is made, not a traceback
    with tempfile.TemporaryDirectory(prefix="lf-lerobot-parity-", dir=args.work) as tmp:
        work = Path(tmp)
        for name, src, own in build_datasets(work, args):
            shards = work / (src.name + "-shards")
            summary = run_job(PreprocessConfig(input=str(src), output=str(shards), workers=1, progress_s=0),
                              IN_MEMORY)
            meta, _ = discover(str(src))
            clamped = clamped_rows(src)
            for setting, deltas in delta_settings(meta, own).items():
                theirs = lerobot_items(args.lerobot_venv, src, deltas, work / "items.npz")
                ours = LeRobotDataset(str(shards), delta_timestamps=deltas or None, split="all")
                exact = LeRobotDataset(str(shards), delta_timestamps=deltas or None, split="all", color="pyav")
                r = compare(ours, exact, theirs, deltas, clamped)
                r.update(dataset=name, deltas=setting, frame_timing=summary["frame_timing"]["cameras"],
                         video=bool(ours.meta.video_keys))
                log.info("%s / %s: %s", name, setting, r)
                rows.append(r)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| dataset | deltas | items | lerobot raised (all at rows LoongForge clamps) | keys, dtypes, non-image "
             "values equal | images bit-exact (`color=\"pyav\"`) | images differing where lerobot crosses an "
             "episode | other images, default colour: max / mean /255 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        done = r["items"] - r["lerobot_raised"]
        mism = "; ".join(f"{k}: {n}" for k, n in sorted(r["value_mismatches"].items()))
        raised = f"{r['lerobot_raised']} ({'yes' if r['raised_at_clamped_rows'] == r['lerobot_raised'] else 'NO'})"
        lines.append(f"| {r['dataset']} | {r['deltas']} | {r['items']} | {raised} | {r['values_equal']} / {done}"
                     f"{' (' + mism + ')' if mism else ''} | "
                     f"{r['images_bit_exact'] if r['video'] else 'n/a (PNG features)'} / {done} | "
                     f"{r['images_explained']} | {r['image_max_255']:.0f} / {r['image_mean_255']:.2f}"
                     f"{' (' + str(r['images_unexplained']) + ' UNEXPLAINED)' if r['images_unexplained'] else ''} |")
    return "\n".join(lines)


def check_datasets(roots: list[str]) -> None:
    """Each --dataset a LeRobot v3.0 root, or one line (exit 2) before any work."""
    for root in roots:
        info = Path(root, "meta", "info.json")
        try:
            version = json.loads(info.read_text()).get("codebase_version")
        except (OSError, ValueError) as exc:
            raise UsageError(f"--dataset {root}: no readable meta/info.json ({type(exc).__name__}): not a LeRobot "
                             "dataset root") from None
        if version != "v3.0":
            raise UsageError(f"--dataset {root}: LeRobot {version}; lerobot 0.6.1 reads only v3.0 (convert it with "
                             "lerobot's convert_dataset_v21_to_v30)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lerobot-venv", default=None, metavar="PATH",
                   help="a venv with lerobot 0.6.1, made by benchmarks/lerobot_venv/setup.sh (required)")
    p.add_argument("--dataset", action="append", default=[], metavar="ROOT",
                   help="a LeRobot v3.0 dataset root of your own (lerobot 0.6.1 reads only v3.0), compared instead "
                        "of the fixtures and the generated data; repeat for several")
    p.add_argument("--episodes", type=int, default=4, help="episodes of the generated datasets (4)")
    p.add_argument("--frames", type=int, nargs=2, default=(30, 50), metavar=("A", "B"),
                   help="frames per generated episode, drawn from [A, B] (30 50)")
    p.add_argument("--size", type=int, default=64, help="frame height and width of the generated datasets (64)")
    p.add_argument("--work", default=None, help="directory for the generated data (a temp dir, removed after)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder (lerobot-parity.md and .json)")


def handle(args: argparse.Namespace) -> int:
    if not args.lerobot_venv or not (Path(args.lerobot_venv) / "bin" / "python").exists():
        raise UsageError(f"--lerobot-venv {args.lerobot_venv}: no bin/python; make it with "
                         "bash benchmarks/lerobot_venv/setup.sh PATH")
    check_datasets(args.dataset)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    rows = run(args)
    text = table(rows)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "lerobot-parity.md").write_text(text + "\n")
    Path(args.out, "lerobot-parity.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"results: {Path(args.out, 'lerobot-parity.md')}")
    unexplained = sum(r["images_unexplained"] + len(r["value_mismatches"]) for r in rows)
    return 0 if unexplained == 0 else 1
