"""Stage 2: read one episode's parquet rows (state, action, timestamps, task, image bytes).

v2.x: the episode's own parquet file. v3.0: the rows of this episode inside a file holding many
(`EpisodeSpec.shared_parquet`), selected by `episode_index`; row groups whose statistics exclude
the episode are not read.

Per-row task: GR00T's `annotation.human.action.task_description` column when
present (that is what GR00T conditions on), else LeRobot's `task_index`, else
the episode's first task from the episode metadata.

Every other column of LeRobot's item (`SourceMeta.columns`: next.done, next.reward,
annotation.*, LeRobot's own task_index beside GR00T's, ...) is read into an array of its own, in
the dtype LeRobot's item gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loongforge.preprocess import files
from loongforge.preprocess.lerobot.meta import Column
from loongforge.preprocess.stages.discover import EpisodeSpec, SourceMeta
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
    index: np.ndarray | None = None  # int64 (n,): the source's global frame index (LeRobot's `index`), if any
    images: dict = field(default_factory=dict)  # image camera key -> per row {"bytes": ..., "path": ...}
    columns: dict = field(default_factory=dict)  # array name -> (n, ...) values of a column of LeRobot's item

    @property
    def length(self) -> int:
        return int(self.state.shape[0])

    def select(self, keep: np.ndarray) -> "EpisodeTable":
        """The rows where `keep` is True (rows skipped for want of a frame)."""
        rows = np.flatnonzero(keep)
        return EpisodeTable(
            episode=self.episode, state=self.state[rows], action=self.action[rows], timestamps=self.timestamps[rows],
            frame_index=self.frame_index[rows], task_index=self.task_index[rows], task_text=self.task_text,
            index=self.index[rows] if self.index is not None else None,
            images={k: [v[i] for i in rows] for k, v in self.images.items()},
            columns={k: v[rows] for k, v in self.columns.items()})


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


def _column(table, col: Column, origin: str) -> np.ndarray:
    """(n, *shape) values of one column in the item's dtype; strings as a fixed-width str array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = table.column(col.name).combine_chunks()
    n = len(values)
    if values.null_count:
        raise SourceDataError(f"{origin}: column {col.name!r} has {values.null_count} null rows")
    if col.dtype == "str":
        return np.array(values.to_pylist(), dtype=str).reshape(n, *col.shape)
    while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) or \
            pa.types.is_large_list(values.type):
        values = pc.list_flatten(values)
    try:
        flat = values.to_numpy(zero_copy_only=False).astype(col.dtype)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise SourceDataError(f"{origin}: column {col.name!r} ({values.type}) is not {col.dtype} ({exc})") from None
    size = int(np.prod(col.shape))
    if flat.size != n * size:
        raise SourceDataError(f"{origin}: column {col.name!r} has {flat.size} values for {n} rows of shape "
                              f"{list(col.shape)} (info.json)")
    return flat.reshape(n, *col.shape)


def _may_hold(row_group, column: int, episode: int) -> bool:
    stats = row_group.column(column).statistics
    if stats is None or not stats.has_min_max:
        return True
    return stats.min <= episode <= stats.max


def _episode_rows(f, episode: int, origin: str):
    """The rows of `episode` in a parquet file holding many, in stored order."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    leaves = [pf.metadata.schema.column(i).path for i in range(pf.metadata.num_columns)]  # row-group column order
    if "episode_index" not in leaves:
        raise SourceDataError(f"{origin}: no 'episode_index' column to select episode {episode}'s rows by")
    col = leaves.index("episode_index")
    groups = [i for i in range(pf.num_row_groups) if _may_hold(pf.metadata.row_group(i), col, episode)]
    table = pf.read_row_groups(groups)
    return table.filter(pc.equal(table.column("episode_index"), episode))


def read_table(spec: EpisodeSpec):
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = spec.parquet
    try:
        with files.open_read(spec.parquet) as f:
            table = _episode_rows(f, spec.index, origin) if spec.shared_parquet else pq.read_table(f)
    except FileNotFoundError:
        raise SourceDataError(f"{origin}: parquet file missing") from None
    except (OSError, pa.ArrowException) as exc:
        raise SourceDataError(f"{origin}: unreadable parquet ({exc})") from exc
    if table.num_rows == 0:
        raise SourceDataError(f"{origin}: no rows" + (f" of episode {spec.index}" if spec.shared_parquet else ""))
    return table


def read_episode(spec: EpisodeSpec, meta: SourceMeta) -> EpisodeTable:
    """Raises SourceDataError for a missing, unreadable or inconsistent parquet."""
    table = read_table(spec)
    origin = spec.parquet if not spec.shared_parquet else f"{spec.parquet} (episode {spec.index})"
    n = table.num_rows
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
    columns = {}
    for col in meta.columns:
        if col.name not in table.column_names and col.name != "episode_index":
            raise SourceDataError(f"{origin}: no {col.name!r} column (a feature in info.json)")
        if col.array.startswith("col_"):
            columns[col.array] = _column(table, col, origin)
    images = {}
    for key in meta.image_keys:
        if key not in table.column_names:
            raise SourceDataError(f"{origin}: no {key!r} column (an image feature in info.json)")
        images[key] = table.column(key).to_pylist()
    return EpisodeTable(episode=spec.index, state=state, action=action, timestamps=timestamps,
                        frame_index=frame_index, task_index=task_index, task_text=task_text,
                        index=column("index", None, np.int64), images=images, columns=columns)
