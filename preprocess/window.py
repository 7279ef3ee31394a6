"""Stage 4: cut an episode into training windows (one window = one sample).

A window starting at frame s holds K frames s, s+D, ..., s+(K-1)D (K =
frames_per_sample, D = frame_step); consecutive windows start `stride` frames
apart. Its action chunk is the H rows starting at the window's LAST frame (what
the policy must do next, GR00T's action horizon), padded past the episode end by
repeating the last row; `action_valid` says how many rows are real. Near the end
an episode may not have K frames left: such tail windows are kept down to
`min_frames` frames, so samples have varying frame counts (the trainer buckets
by length) instead of silently dropping the end of every episode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from loongforge.preprocess.episode import EpisodeTable
from loongforge.shared import paths
from loongforge.shared.format import Sample


@dataclass(frozen=True, slots=True)
class Window:
    start: int
    rows: tuple[int, ...]  # parquet/video rows of the K (or fewer) frames
    action_rows: tuple[int, ...]  # H rows, the padding repeats the last real row
    action_valid: int


def plan_windows(n: int, *, frames_per_sample: int, stride: int, frame_step: int, action_horizon: int,
                 min_frames: int) -> list[Window]:
    """Windows of an n-frame episode, in start order. Pure: unit-testable without video."""
    windows = []
    for start in range(0, n, stride):
        available = (n - 1 - start) // frame_step + 1
        k = min(frames_per_sample, available)
        if k < min_frames:
            break  # later starts only have fewer frames left
        rows = tuple(start + i * frame_step for i in range(k))
        last = rows[-1]
        valid = min(action_horizon, n - last)
        action_rows = tuple(last + min(i, valid - 1) for i in range(action_horizon))
        windows.append(Window(start=start, rows=rows, action_rows=action_rows, action_valid=valid))
    return windows


def cut_samples(table: EpisodeTable, frames: dict[str, np.ndarray], windows: list[Window]) -> Iterator[Sample]:
    """One Sample per window; `frames` maps camera slot -> (n, 3h/2, w) NV12 of the episode."""
    for win in windows:
        rows = np.asarray(win.rows, dtype=np.int64)
        task_index, task = table.task(win.rows[0])
        yield Sample(
            key=paths.sample_key(table.episode, int(table.frame_index[win.start])),
            episode=table.episode,
            frame_indices=table.frame_index[rows],
            timestamps=table.timestamps[rows],
            frames={slot: video[rows] for slot, video in frames.items()},
            state=table.state[rows],
            action=table.action[np.asarray(win.action_rows, dtype=np.int64)],
            action_valid=win.action_valid,
            task=task,
            task_index=task_index,
        )
