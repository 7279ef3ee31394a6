"""`loongforge eval RUN --env metaworld:TASK --episodes 50`: a policy and its baselines in closed loop,
on seeds no demonstration used (sim_env.EVAL_SEED_START on), one table.

    summary = closed_loop(EvalRequest(env="metaworld:button-press-topdown-v3", episodes=50, policy="runs/bp",
                                      data="shards/bp"), out="runs/bp/closed_loop")

The policy is a run directory or an exported GR00T directory, served in this process through the same
backend `loongforge serve` uses (serve/backend.py), or a running `loongforge serve` reached through
its socket (`server`). Baselines: the scripted expert (the ceiling), uniform random actions, and
behaviour cloning from the state alone on the run's training episodes (`data`, the shard root it
trained on): ridge and a small MLP, through the run's processor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from loongforge.preprocess.samples.sim_env import DEFAULT_CAMERA, DEFAULT_SIZE, EVAL_SEED_START, SimSpec
from loongforge.shared.dataset import open_root
from loongforge.shared.errors import UsageError
from loongforge.train.data.training_data import load_for_policy
from loongforge.train.serve.backend import Defaults, load_backend
from loongforge.train.serve.client import PolicyClient
from loongforge.train.sim import report
from loongforge.train.sim.agents import ExpertAgent, LocalPolicy, PolicyAgent, RandomAgent, fit_state_agents
from loongforge.train.sim.pool import EnvPool
from loongforge.train.sim.rollout import rollouts, summarize

BASELINES = ("expert", "random", "state-mlp", "state-ridge")


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    env: str
    episodes: int = 50
    policy: str | None = None  # a run directory or an exported GR00T directory
    server: str | None = None  # tcp://HOST:PORT of a running `loongforge serve` (instead of loading `policy`)
    api_token: str | None = None
    data: str | None = None  # the shard root the policy trained on: the state baselines' demonstrations
    baselines: tuple[str, ...] = BASELINES
    action_steps: int = 8  # of each predicted chunk (Isaac-GR00T's n_action_steps for its sim evals)
    num_envs: int = 4
    seed_start: int = EVAL_SEED_START
    videos: int = 3  # episodes of each agent recorded as mp4
    samples: int | None = None  # flow samples averaged per chunk (None: the server's default, Policy's 8)
    flow_steps: int | None = None
    size: int | None = None  # render size (None: the data root's camera, else DEFAULT_SIZE)
    camera: str = DEFAULT_CAMERA
    max_steps: int | None = None  # None: the task's own limit
    device: str = "cpu"

    def __post_init__(self):
        SimSpec.parse(self.env)
        if self.episodes < 1 or self.num_envs < 1 or self.action_steps < 1 or self.videos < 0:
            raise UsageError("--episodes, --num-envs and --action-steps must be >= 1, --videos >= 0")
        unknown = sorted(set(self.baselines) - set(BASELINES))
        if unknown:
            raise UsageError(f"--baselines {unknown}: choose from {BASELINES}")
        if self.seed_start < EVAL_SEED_START:
            raise UsageError(f"--seed-start {self.seed_start}: rollouts use seeds >= {EVAL_SEED_START}; the ones "
                             "below are the demonstrations'")


def _render_size(req: EvalRequest) -> int:
    if req.size:
        return req.size
    if req.data:
        h, w = open_root(req.data).info.camera_size(0)  # render what the policy trained on
        if h != w:
            raise UsageError(f"{req.data}: its camera is {h}x{w}; the sim renders square frames (--size N)")
        return int(h)
    return DEFAULT_SIZE


def _policy(req: EvalRequest):
    """(the served policy, its backend or None)."""
    options = {k: v for k, v in (("samples", req.samples), ("steps", req.flow_steps)) if v is not None}
    if req.server:
        host, _, port = req.server.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--server {req.server!r}: tcp://HOST:PORT")
        return PolicyClient(host.strip("[]"), int(port), api_token=req.api_token, timeout_ms=120000), None, options
    backend = load_backend(req.policy, device=req.device, defaults=Defaults())
    return LocalPolicy(backend), backend, options


def agents_for(req: EvalRequest, spec: SimSpec) -> list:
    out = []
    backend = None
    if req.policy or req.server:
        served, backend, options = _policy(req)
        out.append(PolicyAgent(served, spec.instruction, req.camera, options=options))
    horizon = out[0].horizon if out else 16
    for name in req.baselines:
        if name == "expert":
            out.append(ExpertAgent())
        elif name == "random":
            out.append(RandomAgent(horizon))
    states = [b for b in req.baselines if b.startswith("state-")]
    if states:
        if backend is None or not req.data:
            missing = "--data (the shard root the policy trained on)" if not req.data else "a policy loaded here"
            raise UsageError(f"the state baselines {states} need {missing}; or leave them out with --baselines")
        p = backend.policy
        data = load_for_policy(req.data, {"data": {"video_deltas": [0], "action_horizon": horizon}}, horizon)
        out += fit_state_agents(data, p.processor, backend.tag, names=tuple(states))
    return out


def closed_loop(req: EvalRequest, out: str, log=print) -> dict:
    spec = SimSpec.parse(req.env)
    size = _render_size(req)
    agents = agents_for(req, spec)
    if not agents:
        raise UsageError("nothing to evaluate: give a policy (RUN or --server) or baselines")
    os.makedirs(out, exist_ok=True)
    seeds = list(range(req.seed_start, req.seed_start + req.episodes))
    rows, videos = [], []
    with EnvPool(spec, envs=min(req.num_envs, req.episodes), size=size, camera=req.camera,
                 max_steps=req.max_steps) as pool:
        for agent in agents:
            episodes, stats = rollouts(agent, pool, seeds, action_steps=req.action_steps, record=req.videos, log=log)
            row = summarize(agent.name, episodes, stats)
            rows.append(row)
            videos += report.write_videos(out, agent.name, episodes[:req.videos], pool.fps)
            log(f"{agent.name}: {row['successes']}/{row['episodes']} successes, {stats.wall_s:.1f} s "
                f"({row['stats']['env_steps_per_s']} env steps/s)")
        max_steps = pool.max_steps
    summary = {"env": str(spec), "task": spec.instruction, "episodes": req.episodes, "seeds": seeds,
               "action_steps": req.action_steps, "max_steps": max_steps, "size": size, "camera": req.camera,
               "policy": req.policy or req.server, "data": req.data, "agents": rows, "videos": videos}
    report.write_summary(out, summary)
    summary["plot"] = report.plot(out, summary)
    report.write_summary(out, summary)
    return summary

