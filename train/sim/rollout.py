"""Closed-loop rollouts: observation -> agent -> action chunk -> `action_steps` of it in the env -> ...,
until the task succeeds or reaches its step limit (Isaac-GR00T's rollout_policy.py convention: each
predicted chunk is executed for n_action_steps, then the policy looks again).

Every env of the pool runs one episode at a time; the agent answers all running envs in one batch
(one forward of the policy), and a finished env takes the next seed. Episode k runs seed
`seed_start + k`, so any agent meets the same scenes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from loongforge.shared.errors import ConfigError
from loongforge.train.sim.pool import EnvPool

PROGRESS_EVERY = 10  # episodes between progress lines


@dataclass
class Episode:
    index: int
    seed: int
    success: bool
    steps: int  # env steps until success (or the limit)
    frames: list | None = None  # recorded episodes: the frame before every step (what the policy saw)

    def row(self) -> dict:
        out = asdict(self)
        out.pop("frames")
        return out


@dataclass
class Stats:
    env_steps: int = 0
    renders: int = 0
    render_s: float = 0.0
    step_s: float = 0.0
    agent_s: float = 0.0  # the agent's own time (the policy's forward), in the rollout process
    agent_calls: int = 0
    wall_s: float = 0.0

    def to_json(self) -> dict:
        return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()},
                "env_steps_per_s": round(self.env_steps / max(self.wall_s, 1e-9), 1),
                "render_frames_per_s": round(self.renders / self.render_s, 1) if self.renders else None}


def rollouts(agent, pool: EnvPool, seeds: list[int], *, action_steps: int, record: int = 0,
             log=None) -> tuple[list[Episode], Stats]:
    """Run one episode per seed with `agent`; the first `record` episodes keep their frames. `log`: a line
    every PROGRESS_EVERY finished episodes."""
    horizon = getattr(agent, "horizon", action_steps)
    if not 1 <= action_steps <= horizon:
        raise ConfigError(f"--action-steps {action_steps}: between 1 and the policy's action horizon ({horizon})")
    t0, stats = time.perf_counter(), Stats()
    pending = deque(enumerate(seeds))
    live: dict[int, list] = {}  # env -> [episode index, seed, last Step, recorded frames or None]
    done: list[Episode] = []

    def start(i: int) -> None:
        k, seed = pending.popleft()
        rec = k < record
        agent.reset(i, seed)
        step = pool.reset(i, seed, record=rec, render=agent.needs_frames)
        _count(stats, step)
        live[i] = [k, seed, step, [] if rec else None]

    for i in range(len(pool)):
        if pending:
            start(i)
    while live:
        ids = sorted(live)
        t = time.perf_counter()
        chunks = agent.act([live[i][2] for i in ids], ids)
        stats.agent_s += time.perf_counter() - t
        stats.agent_calls += 1
        for j, i in enumerate(ids):
            pool.send(i, None if chunks is None else chunks[j][:action_steps], action_steps, render=agent.needs_frames)
        for i in ids:
            step = pool.receive(i)
            _count(stats, step)
            k, seed, last, frames = live[i]
            stats.env_steps += step.steps - last.steps
            if frames is not None:
                frames.extend(step.recorded)
            if step.done:
                done.append(Episode(k, seed, step.success, step.steps, frames))
                if log and len(done) % PROGRESS_EVERY == 0 and len(done) < len(seeds):
                    log(f"{agent.name}: {len(done)}/{len(seeds)} episodes, {sum(e.success for e in done)} successes, "
                        f"{time.perf_counter() - t0:.0f} s")
                del live[i]
                if pending:
                    start(i)
            else:
                live[i][2] = step
    stats.wall_s = time.perf_counter() - t0
    return sorted(done, key=lambda e: e.index), stats


def _count(stats: Stats, step) -> None:
    stats.renders += step.renders
    stats.render_s += step.render_s
    stats.step_s += step.step_s


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate (sound at 0 and n successes, unlike p +- 1.96 se)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(name: str, episodes: list[Episode], stats: Stats) -> dict:
    wins = [e for e in episodes if e.success]
    lo, hi = wilson(len(wins), len(episodes))
    return {"agent": name, "episodes": len(episodes), "successes": len(wins),
            "success_rate": len(wins) / max(len(episodes), 1), "ci95": [round(lo, 4), round(hi, 4)],
            "mean_steps_to_success": float(np.mean([e.steps for e in wins])) if wins else None,
            "stats": stats.to_json(), "rows": [e.row() for e in episodes]}
