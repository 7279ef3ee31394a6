"""LeRobot v2.0 / v2.1 episode listing: one parquet and one mp4 per camera per episode.

    data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet
    videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4
    meta/episodes.jsonl, meta/tasks.jsonl, meta/stats.json (v2.0) or meta/episodes_stats.jsonl (v2.1)

Real datasets ship with inconsistent metadata (GR00T's own sample data among them): `total_chunks: 0`,
`splits` naming episodes that do not exist, no episodes.jsonl. Each is tolerated with a warning,
because the files themselves are the truth: chunks are derived from `chunks_size`, episodes are
listed from the parquet files when episodes.jsonl is missing.
"""

from __future__ import annotations

import re

from loongforge.preprocess import files
from loongforge.preprocess.lerobot.meta import CameraSource, aggregate_stats, parse_json, parse_jsonl

DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
META_FILES = ("episodes.jsonl", "tasks.jsonl", "stats.json", "episodes_stats.jsonl")


def episode_rows(raw: dict[str, bytes], listing: set[str], warn) -> list[dict]:
    """episodes.jsonl's rows sorted by episode index, or one row per parquet file when it is missing."""
    if "episodes.jsonl" in raw:
        rows = parse_jsonl(raw["episodes.jsonl"], "meta/episodes.jsonl")
    else:
        warn("no meta/episodes.jsonl; listing episodes from the parquet files")
        rows = [{"episode_index": int(m.group(1))} for f in sorted(listing)
                if (m := re.search(r"episode_(\d+)\.parquet$", f))]
    return sorted(rows, key=lambda r: int(r["episode_index"]))


def list_episodes(root: str, info: dict, rows: list[dict], cams: list[CameraSource]):
    """EpisodeSpec fields of every episode row: (index, length, tasks, parquet, videos)."""
    data_tpl = info.get("data_path") or DATA_PATH
    video_tpl = info.get("video_path") or VIDEO_PATH
    chunks_size = int(info.get("chunks_size") or 1000)
    out = []
    for row in rows:
        ep = int(row["episode_index"])
        loc = {"episode_chunk": ep // chunks_size, "episode_index": ep}
        videos = tuple((c.key, files.join(root, video_tpl.format(video_key=c.key, **loc)))
                       for c in cams if c.kind == "video")
        out.append(dict(index=ep, length=int(row.get("length", -1)), tasks=tuple(row.get("tasks", ())),
                        parquet=files.join(root, data_tpl.format(**loc)), videos=videos))
    return out


def tasks(raw: dict[str, bytes]) -> dict[int, str]:
    return {int(r["task_index"]): str(r["task"]) for r in parse_jsonl(raw.get("tasks.jsonl", b""), "meta/tasks.jsonl")}


def stats(raw: dict[str, bytes]) -> dict:
    """LeRobot's statistics as it would load them: stats.json (v2.0), else the per-episode
    statistics of episodes_stats.jsonl (v2.1) aggregated; {} when neither exists."""
    if "stats.json" in raw:
        return parse_json(raw["stats.json"], "meta/stats.json")
    if "episodes_stats.jsonl" in raw:
        rows = parse_jsonl(raw["episodes_stats.jsonl"], "meta/episodes_stats.jsonl")
        return aggregate_stats([r.get("stats", {}) for r in rows])
    return {}
