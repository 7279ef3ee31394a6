"""LeRobot v3.0 episode listing: many episodes per parquet file and per mp4 file.

    data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet             rows of many episodes
    videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4   many episodes, concatenated
    meta/episodes/chunk-*/file-*.parquet   one row per episode: length, tasks, its data file, and per
                                           camera its video file and [from_timestamp, to_timestamp)
    meta/tasks.parquet                     task_index, task
    meta/stats.json                        statistics over the dataset

An episode's frames are located inside its camera's file by time: the frame shown at episode
time ts is the file's frame at from_timestamp + ts (what LeRobotDataset decodes). Episodes of one
file are converted independently (one Beam element each); every worker opens the file and seeks
to its episode's span.
"""

from __future__ import annotations

import io

from loongforge.preprocess import files
from loongforge.preprocess.lerobot.meta import CameraSource, aggregate_stats, parse_json
from loongforge.shared.errors import SourceDataError

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_DIR = "meta/episodes"
META_FILES = ("stats.json",)


def _read_parquet(path: str, origin: str, columns: list[str] | None = None, optional: bool = False):
    """The table (None when `optional` and the file does not exist)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with files.open_read(path) as f:
            table = pq.read_table(io.BytesIO(f.read()))
    except FileNotFoundError:
        if optional:
            return None
        raise SourceDataError(f"{origin}: missing") from None
    except (OSError, pa.ArrowException) as exc:
        raise SourceDataError(f"{origin}: unreadable parquet ({exc})") from exc
    missing = sorted(set(columns or ()) - set(table.column_names))
    if missing:
        raise SourceDataError(f"{origin}: no column(s) {missing}; is this a LeRobot v3.0 dataset?")
    return table


def episode_tables(root: str) -> list[tuple[str, object]]:
    """(relative path, table) of every meta/episodes parquet file, in path order."""
    try:
        listed = sorted(f for f in files.list_files(root, EPISODES_DIR) if f.endswith(".parquet"))
    except FileNotFoundError:
        listed = []
    if not listed:
        raise SourceDataError(f"{root}: codebase_version v3.0 but no {EPISODES_DIR}/chunk-*/file-*.parquet: the "
                              "episode metadata is missing")
    return [(rel, _read_parquet(files.join(root, rel), rel)) for rel in listed]


def list_episodes(root: str, info: dict, tables: list, cams: list[CameraSource]) -> list[dict]:
    """EpisodeSpec fields of every episode (sorted by index): its data file (shared with other
    episodes), and per video camera its file and span."""
    data_tpl = info.get("data_path") or DATA_PATH
    video_tpl = info.get("video_path") or VIDEO_PATH
    videos = [c for c in cams if c.kind == "video"]
    need = ["episode_index", "length", "data/chunk_index", "data/file_index"]
    for c in videos:
        need += [f"videos/{c.key}/{k}" for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    out = []
    for rel, table in tables:
        missing = sorted(set(need) - set(table.column_names))
        if missing:
            raise SourceDataError(f"{rel}: no column(s) {missing}")
        cols = {name: table.column(name).to_pylist() for name in need}
        task_lists = table.column("tasks").to_pylist() if "tasks" in table.column_names else [None] * table.num_rows
        for i in range(table.num_rows):
            data = data_tpl.format(chunk_index=cols["data/chunk_index"][i], file_index=cols["data/file_index"][i])
            paths, spans = [], []
            for c in videos:
                col = f"videos/{c.key}/"
                rel = video_tpl.format(video_key=c.key, chunk_index=cols[col + "chunk_index"][i],
                                       file_index=cols[col + "file_index"][i])
                paths.append((c.key, files.join(root, rel)))
                spans.append((float(cols[col + "from_timestamp"][i]), float(cols[col + "to_timestamp"][i])))
            out.append(dict(index=int(cols["episode_index"][i]), length=int(cols["length"][i]),
                            tasks=tuple(task_lists[i] or ()), parquet=files.join(root, data), videos=tuple(paths),
                            spans=tuple(spans), shared_parquet=True))
    return sorted(out, key=lambda e: e["index"])


def tasks(root: str) -> dict[int, str]:
    table = _read_parquet(files.join(root, "meta", "tasks.parquet"), "meta/tasks.parquet", optional=True)
    if table is None:
        return {}
    text = "task" if "task" in table.column_names else "__index_level_0__"
    if "task_index" not in table.column_names or text not in table.column_names:
        raise SourceDataError(f"meta/tasks.parquet: columns {table.column_names}, expected task_index and task")
    return {int(i): str(t) for i, t in zip(table.column("task_index").to_pylist(), table.column(text).to_pylist())}


def stats(raw: dict[str, bytes], tables: list) -> dict:
    """stats.json, else the per-episode `stats/<feature>/<stat>` columns of meta/episodes aggregated."""
    if "stats.json" in raw:
        return parse_json(raw["stats.json"], "meta/stats.json")
    per_episode = []
    for _, table in tables:
        cols = [c for c in table.column_names if c.startswith("stats/") and c.count("/") == 2]
        rows = {c: table.column(c).to_pylist() for c in cols}
        for i in range(table.num_rows):
            ep: dict = {}
            for c in cols:
                _, key, stat = c.split("/")
                ep.setdefault(key, {})[stat] = rows[c][i]
            per_episode.append(ep)
    return aggregate_stats(per_episode)
