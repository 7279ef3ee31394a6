"""Stage 2: read one episode's parquet (state, action, timestamps, task per row).

Per-row task: GR00T's `annotation.human.action.task_description` column when
present (that is what GR00T conditions on), else LeRobot's `task_index`, else
the episode's first task from episodes.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loongforge.preprocess import files
from loongforge.preprocess.discover import EpisodeSpec, SourceMeta
from loongforge.shared.errors import SourceDataError

TASK_COLUMNS = ("annotation.human.action.task_description", "task_index")


@dataclass(slots=True)
class EpisodeTable:
    episode: int
    state: np.ndarray  # float32 (n, state_dim)
    action: np.ndarray  # float32 (n, action_dim)
    timestamps: np.ndarray  # float64 (n,)
    frame_index: np.ndarray  # int64 (n,)
    task_index: np.ndarray  # int64 (n,); -1 where unknown
    task_text: dict  # task_index -> instruction

    @property
    def length(self) -> int:
        return int(self.state.shape[0])


def _matrix(table, column: str, dim: int, origin: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if column not in table.column_names:
        raise SourceDataError(f"{origin}: no {column!r} column")
    col = table.column(column).combine_chunks()
    n = len(col)
    if not (pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type)):
        raise SourceDataError(f"{origin}: column {column!r} is {col.type}, expected a list of floats per row")
    if col.null_count:
        raise SourceDataError(f"{origin}: column {column!r} has {col.null_count} null rows")
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if dim <= 0 and n:
        dim = flat.size // n
    if flat.size != n * dim:
        raise SourceDataError(f"{origin}: column {column!r} has {flat.size} values for {n} rows of {dim}")
    return flat.reshape(n, dim)


def read_episode(spec: EpisodeSpec, meta: SourceMeta) -> EpisodeTable:
    """Raises SourceDataError for a missing, unreadable or inconsistent parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = spec.parquet
    try:
        with files.open_read(spec.parquet) as f:
            table = pq.read_table(f)
    except FileNotFoundError:
        raise SourceDataError(f"{origin}: parquet file missing") from None
    except (OSError, pa.ArrowException) as exc:
        raise SourceDataError(f"{origin}: unreadable parquet ({exc})") from exc
    n = table.num_rows
    if n == 0:
        raise SourceDataError(f"{origin}: no rows")
    state = _matrix(table, "observation.state", meta.state_dim, origin)
    action = _matrix(table, "action", meta.action_dim, origin)

    def column(name: str, default, dtype):
        if name in table.column_names:
            return table.column(name).to_numpy().astype(dtype)
        return default

    timestamps = column("timestamp", np.arange(n, dtype=np.float64) / (meta.fps or 1.0), np.float64)
    frame_index = column("frame_index", np.arange(n, dtype=np.int64), np.int64)
    task_index = np.full(n, -1, np.int64)
    for name in TASK_COLUMNS:
        if name in table.column_names:
            task_index = column(name, task_index, np.int64)
            break
    task_text = dict(meta.tasks)
    if spec.tasks:
        task_text[-1] = spec.tasks[0]  # fallback for rows without a task index
    return EpisodeTable(episode=spec.index, state=state, action=action, timestamps=timestamps,
                        frame_index=frame_index, task_index=task_index, task_text=task_text)
