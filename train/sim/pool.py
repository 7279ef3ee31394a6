"""Simulated envs in worker processes, stepped a chunk at a time.

    with EnvPool("metaworld:button-press-topdown-v3", envs=4, size=56) as pool:
        pool.reset(0, seed=1_000_000)               # -> Step(state, frame, success=False, steps=0)
        pool.send(0, actions)                       # (k, 4): up to k env steps, stopping at success or the limit
        step = pool.receive(0)                      # the state and frame after them

Each worker owns one SimEnv (preprocess/samples/sim_env.py: its renderer and scripted expert) in a
spawned process that imports no torch. A chunk crosses the pipe once and the worker runs its k steps
itself, so the policy's process sees one message per chunk per env; the frame is rendered only
where the policy will look at it (after the chunk) and, for a recorded episode, before every step.
`actions=None` runs the task's scripted expert for k steps (it reads the simulator's full state,
which never leaves the worker).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from loongforge.preprocess.samples.sim_env import SimEnv, SimSpec
from loongforge.shared.errors import ConfigError

REPLY_TIMEOUT_S = 300.0  # a worker silent this long is stuck (a chunk of 16 steps takes milliseconds)


@dataclass
class Step:
    state: dict  # {state key: (D,)} robot units
    frame: np.ndarray | None  # (H, W, 3) uint8, None when the episode ended
    success: bool
    steps: int  # env steps of the episode so far
    done: bool  # success, or the task's step limit
    recorded: list = field(default_factory=list)  # frames before each step of the chunk (recorded episodes)
    render_s: float = 0.0
    step_s: float = 0.0
    renders: int = 0


def _worker(conn, spec: str, size: int, camera: str, max_steps: int | None) -> None:
    try:
        env = SimEnv(SimSpec.parse(spec), size=size, camera=camera)
    except Exception as exc:  # reported to the parent as one line
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    limit = max_steps or env.max_steps
    conn.send(("ready", {"max_steps": limit, "fps": env.fps}))
    steps, record = 0, False
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "close":
                env.close()
                return
            if msg[0] == "reset":
                _, seed, record, render = msg
                state, steps = env.reset(seed), 0
                t = time.perf_counter()
                frame = env.render() if render or record else None
                conn.send(("ok", Step(state, frame, False, 0, False, render_s=time.perf_counter() - t,
                                      renders=int(frame is not None))))
                continue
            _, actions, k, render = msg  # "act"
            out = Step({}, None, False, steps, False)
            for i in range(k):
                if record:
                    t = time.perf_counter()
                    out.recorded.append(env.render())
                    out.render_s, out.renders = out.render_s + time.perf_counter() - t, out.renders + 1
                t = time.perf_counter()
                a = env.expert() if actions is None else actions[i]
                state, ok = env.step(a)
                out.step_s += time.perf_counter() - t
                steps += 1
                if ok or steps >= limit:
                    out.success, out.done = ok, True
                    break
            out.state, out.steps = state, steps
            if render and not out.done:
                t = time.perf_counter()
                out.frame = env.render()
                out.render_s, out.renders = out.render_s + time.perf_counter() - t, out.renders + 1
            conn.send(("ok", out))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


class EnvPool:
    def __init__(self, spec: str | SimSpec, *, envs: int, size: int, camera: str, max_steps: int | None = None):
        if envs < 1:
            raise ConfigError(f"--num-envs {envs}: at least 1")
        ctx = mp.get_context("spawn")  # never fork a process holding torch's threads
        self.conns, self.procs = [], []
        for _ in range(envs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, str(spec), size, camera, max_steps), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        infos = [self._reply(i) for i in range(envs)]
        self.max_steps, self.fps = infos[0]["max_steps"], infos[0]["fps"]

    def __len__(self) -> int:
        return len(self.conns)

    def _reply(self, i: int):
        if not self.conns[i].poll(REPLY_TIMEOUT_S):
            raise ConfigError(f"sim worker {i} gave no reply in {REPLY_TIMEOUT_S:.0f} s")
        try:
            kind, value = self.conns[i].recv()
        except EOFError:
            raise ConfigError(f"sim worker {i} died (exit code {self.procs[i].exitcode})") from None
        if kind == "error":
            raise ConfigError(f"sim worker {i}: {value}")
        return value

    def reset(self, i: int, seed: int, record: bool = False, render: bool = True) -> Step:
        """Env i on the scene of `seed`; `record`: keep every frame of this episode; `render`: the policy
        looks at the frames (a state-only policy does not, and pays no rendering)."""
        self.conns[i].send(("reset", int(seed), bool(record), bool(render)))
        return self._reply(i)

    def send(self, i: int, actions: np.ndarray | None, k: int, render: bool = True) -> None:
        """Start k steps of env i: actions (>= k, 4), or None for the scripted expert."""
        self.conns[i].send(("act", None if actions is None else np.asarray(actions, np.float32), int(k),
                            bool(render)))

    def receive(self, i: int) -> Step:
        return self._reply(i)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.conns, self.procs = [], []

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
