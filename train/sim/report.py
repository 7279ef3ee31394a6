"""What a closed-loop eval leaves behind: the success table (printed and closed_loop.json), per-episode
rows, rollout mp4s of the first episodes (the frames the policy saw) and a plot (success rate with its
95% interval per agent, steps to success)."""

from __future__ import annotations

import json
import os

import numpy as np

from loongforge.preprocess.samples.dataset import encode_mp4
from loongforge.shared.storage import write_bytes_atomic

VIDEO_SCALE = 4  # the mp4s show the policy's own frames (56 px for tiny), enlarged by pixel repetition


def format_table(summary: dict) -> str:
    head = (f"closed loop: {summary['env']}, {summary['episodes']} episodes (seeds {summary['seeds'][0]}.."
            f"{summary['seeds'][-1]}, none used for training), {summary['action_steps']} action steps per chunk, "
            f"limit {summary['max_steps']} steps")
    lines = [head, "| agent | success | 95% interval | mean steps to success | env steps/s | frames rendered/s |",
             "|---|---|---|---|---|---|"]
    for r in summary["agents"]:
        steps = "-" if r["mean_steps_to_success"] is None else f"{r['mean_steps_to_success']:.1f}"
        fps = r["stats"]["render_frames_per_s"]
        lines.append(f"| {r['agent']} | {r['successes']}/{r['episodes']} ({100 * r['success_rate']:.0f}%) | "
                     f"{100 * r['ci95'][0]:.0f}-{100 * r['ci95'][1]:.0f}% | {steps} | "
                     f"{r['stats']['env_steps_per_s']:.0f} | {'-' if fps is None else f'{fps:.0f}'} |")
    return "\n".join(lines)


def write_videos(out: str, agent: str, episodes, fps: int) -> list[str]:
    paths = []
    for e in episodes:
        if not e.frames:
            continue
        frames = np.stack(e.frames)
        if VIDEO_SCALE > 1:
            frames = frames.repeat(VIDEO_SCALE, axis=1).repeat(VIDEO_SCALE, axis=2)
        name = f"{agent}_ep{e.index:03d}_seed{e.seed}_{'success' if e.success else 'fail'}.mp4"
        path = os.path.join(out, "videos", name)
        encode_mp4(path, frames, fps=fps, gop=fps, crf=20)
        paths.append(path)
    return paths


def write_summary(out: str, summary: dict) -> str:
    path = os.path.join(out, "closed_loop.json")
    write_bytes_atomic(path, (json.dumps(summary, indent=2) + "\n").encode())
    with open(os.path.join(out, "closed_loop.md"), "w", encoding="utf-8") as f:
        f.write(format_table(summary) + "\n")
    return path


def plot(out: str, summary: dict) -> str:
    import matplotlib  # heavy: only for the chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = summary["agents"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["agent"] for r in agents]
    rate = np.array([r["success_rate"] for r in agents]) * 100
    lo = rate - np.array([r["ci95"][0] for r in agents]) * 100
    hi = np.array([r["ci95"][1] for r in agents]) * 100 - rate
    a.bar(names, rate, yerr=[lo, hi], capsize=4, color="#4c72b0")
    a.set_ylim(0, 105)
    a.set_ylabel("success rate, % (95% Wilson interval)")
    a.set_title(f"{summary['env']}: {summary['episodes']} unseen seeds")
    wins = {r["agent"]: [row["steps"] for row in r["rows"] if row["success"]] for r in agents}
    top = max([max(v) for v in wins.values() if v] or [summary["max_steps"]])
    for name, steps in wins.items():
        if steps:
            b.hist(steps, bins=20, range=(0, 1.1 * top), alpha=0.5, label=name)
    b.set_xlabel("env steps to success")
    b.set_ylabel("episodes")
    b.legend()
    fig.tight_layout()
    path = os.path.join(out, "closed_loop.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
