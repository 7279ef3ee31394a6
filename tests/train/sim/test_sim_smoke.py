"""The simulator chain in seconds: one expert demonstration of a real Meta-World task written as LeRobot
v3.0 (real H.264 through PyAV) and read back as any dataset, then rollouts through the env workers:
the expert, random actions, and a policy behind the serving interface, in process and through
`loongforge serve`'s socket (a stand-in backend: no model). The whole chain with a trained policy
is `loongforge bench closed-loop` (and the `full` test below)."""

from __future__ import annotations

import json
import threading

import av
import numpy as np
import pytest

from loongforge.preprocess.samples.sim_demos import write_demos
from loongforge.preprocess.samples.sim_env import (ACTION_KEYS, EVAL_SEED_START, STATE_KEYS, SimEnv, SimSpec,
                                                   modality_json)
from loongforge.preprocess.stages.discover import discover
from loongforge.shared.errors import ConfigError
from loongforge.train.serve.client import PolicyClient
from loongforge.train.serve.server import PolicyServer, ServeConfig
from loongforge.train.sim.agents import ExpertAgent, LocalPolicy, PolicyAgent, RandomAgent
from loongforge.train.sim.pool import EnvPool
from loongforge.train.sim.rollout import rollouts, summarize, wilson

TASK = "metaworld:button-press-topdown-v3"
SIZE = 32  # small frames: the smoke pays rendering per step


def test_a_spec_names_a_backend_and_a_task():
    assert SimSpec.parse(TASK).task == "button-press-topdown-v3"
    assert SimSpec.parse(TASK).instruction == "button press topdown"
    for bad in ("button-press-topdown-v3", "gym:cartpole", "metaworld:"):
        with pytest.raises(ConfigError, match="BACKEND:TASK"):
            SimSpec.parse(bad)
    with pytest.raises(ConfigError, match="no such Meta-World task"):
        SimEnv.make("metaworld:no-such-task-v3", size=SIZE)


def test_a_seed_is_one_scene():
    env = SimEnv.make(TASK, size=SIZE)
    try:
        a, fa = env.reset(3), env.render()
        env.step(np.ones(4, np.float32))
        b, fb = env.reset(3), env.render()
        env.reset(4)
        fc = env.render()
        assert all(np.array_equal(a[k], b[k]) for k in STATE_KEYS) and np.array_equal(fa, fb)
        assert fa.shape == (SIZE, SIZE, 3) and fa.dtype == np.uint8
        assert not np.array_equal(fa, fc)  # another seed, the button elsewhere
    finally:
        env.close()


def test_one_expert_demonstration_is_a_lerobot_v3_dataset(tmp_path):
    out = tmp_path / "demos"
    summary = write_demos(out, TASK, episodes=1, size=SIZE)
    assert summary["episodes"] == 1 and summary["failed"] == 0 and summary["seeds"] == [0]
    steps = summary["steps"][0]
    assert 20 < steps < 500  # the expert presses the button well within the task's limit
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_frames"] == steps
    assert json.loads((out / "meta/modality.json").read_text()) == modality_json("corner2")
    assert json.loads((out / "meta/sim.json").read_text())["env"] == TASK
    meta, episodes = discover(str(out))  # what `loongforge preprocess` reads first
    assert [c.key for c in meta.cameras] == ["observation.images.corner2"] and len(episodes) == 1
    assert meta.tasks == {0: "button press topdown"}
    with av.open(str(next((out / "videos").rglob("*.mp4")))) as c:
        assert c.streams.video[0].codec_context.name == "h264"
        assert sum(1 for _ in c.decode(video=0)) == steps
    with pytest.raises(ConfigError, match="not empty"):
        write_demos(out, TASK, episodes=1, size=SIZE)


class _Zeros:
    """A served policy's interface (get_modality_config / get_action) with a fixed answer: checks the
    observation the rollout builds, in GR00T's layout."""

    def __init__(self):
        self.seen = []

    def get_modality_config(self):
        keys = lambda ks, h=1: {"delta_indices": list(range(h)), "modality_keys": list(ks)}  # noqa: E731
        return {"video": keys(["corner2"]), "state": keys(STATE_KEYS), "action": keys(ACTION_KEYS, 16),
                "language": keys(["annotation.human.task_description"])}

    def prepare(self, observation, options):
        v = observation["video"]["corner2"]
        assert v.dtype == np.uint8 and v.shape[1:] == (1, SIZE, SIZE, 3)
        assert {k: observation["state"][k].shape[1:] for k in STATE_KEYS} == {"hand_pos": (1, 3), "gripper": (1, 1)}
        assert observation["language"]["annotation.human.task_description"] == [["button press topdown"]] * len(v)
        self.seen.append(len(v))
        return len(v)

    def run(self, b):
        return {k: np.zeros((b, 16, n), np.float32) for k, n in ACTION_KEYS.items()}, {}

    def reset(self, options):
        return {}


def test_rollouts_of_the_expert_random_and_a_served_policy_in_process_and_over_the_socket():
    seeds = [EVAL_SEED_START, EVAL_SEED_START + 1]
    backend = _Zeros()
    server = PolicyServer(ServeConfig(port=0, poll_ms=20))
    thread = threading.Thread(target=server.serve_forever, args=(backend,), daemon=True)
    thread.start()
    try:
        with EnvPool(TASK, envs=2, size=SIZE, camera="corner2", max_steps=24) as pool, \
                PolicyClient("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])) as client:
            expert, _ = rollouts(ExpertAgent(), pool, seeds, action_steps=8)
            assert [e.steps for e in expert] == [24, 24]  # the limit, before the button
            rand, stats = rollouts(RandomAgent(16), pool, seeds, action_steps=8, record=1)
            assert [e.success for e in rand] == [False, False] and len(rand[0].frames) == 24 and rand[1].frames is None
            for policy in (LocalPolicy(backend), client):
                agent = PolicyAgent(policy, "button press topdown", "corner2")
                eps, stats = rollouts(agent, pool, seeds, action_steps=8)
                assert [e.steps for e in eps] == [24, 24] and stats.env_steps == 48 and stats.agent_calls == 3
            assert backend.seen == [2, 2, 2] * 2  # both envs answered in one batch, every chunk
            with pytest.raises(ConfigError, match="action horizon"):
                rollouts(agent, pool, seeds, action_steps=17)
        row = summarize("random", rand, stats)
        assert row["successes"] == 0 and row["ci95"][0] == 0.0 and len(row["rows"]) == 2
    finally:
        server.stop()
        thread.join(10)


def test_a_policy_trained_on_other_keys_is_refused_with_the_keys():
    class Other(_Zeros):
        def get_modality_config(self):
            cfg = super().get_modality_config()
            return {**cfg, "state": {"delta_indices": [0], "modality_keys": ["arm"]}}

    with pytest.raises(ConfigError, match=r"state keys \['arm'\]; this env gives \['hand_pos', 'gripper'\]"):
        PolicyAgent(Other(), "x", "corner2")


def test_the_wilson_interval():
    assert wilson(0, 50)[0] == 0.0 and wilson(50, 50)[1] == 1.0
    lo, hi = wilson(40, 50)
    assert 0.66 < lo < 0.67 and 0.88 < hi < 0.89


@pytest.mark.full  # minutes: a training launch; the chain's parts are the tests above (make test)
def test_the_closed_loop_bench_quick_runs_the_whole_chain(tmp_path):
    """demos -> preprocess -> train -> open-loop and closed-loop eval through the real commands."""
    import subprocess
    import sys

    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "loongforge", "bench", "closed-loop", "--quick", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(next(out.glob("closed-loop-*.json")).read_text())
    agents = {r["agent"]: r for r in doc["closed_loop"]["agents"]}
    assert set(agents) == {"loongforge", "expert", "random", "state-mlp", "state-ridge"}
    assert all(r["episodes"] == 3 for r in agents.values())
    assert (out / next(out.glob("closed-loop-*.json")).stem / "closed_loop" / "closed_loop.png").exists()
    assert doc["stages"]["train"]["cpu_s"] > 0 and doc["load_avg_before"]


def test_eval_refuses_what_it_cannot_do_in_one_line(tmp_path, capsys):
    from loongforge.cli import main

    assert main(["eval", "--env", TASK, "--episodes", "1", "2", "--baselines", "expert"]) == 2
    assert "--episodes takes one number" in capsys.readouterr().err
    assert main(["eval"]) == 2  # open loop needs RUN and --data
    assert main(["eval", "--env", "gym:cartpole", "--baselines", "expert"]) != 0
    assert main(["eval", "--env", TASK, "--baselines", "expert,state-mlp", "--episodes", "1",
                 "--out", str(tmp_path)]) == 2  # the state baselines need a policy and its data
    assert "state baselines" in capsys.readouterr().err
