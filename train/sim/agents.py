"""What acts in a rollout: the policy behind the serving interface, and the baselines it is judged against.

    PolicyAgent(backend_or_client, instruction, camera)  a trained run or an export, in process (the
                   serve backend: prepare + run) or through `loongforge serve`'s socket (PolicyClient):
                   GR00T's observation layout in, per-key actions in robot units out; the run's
                   processor does every normalisation (train/data/processor.py)
    ExpertAgent    the task's scripted expert (the ceiling; it reads the simulator's full state, so it
                   runs inside the env worker)
    RandomAgent    uniform actions in the env's [-1, 1], seeded per episode
    StateAgent     behaviour cloning from the state alone on the same demonstrations, in the model's
                   units through the run's processor: "state-ridge" (closed form, eval/baselines.py's
                   open-loop ridge) and "state-mlp" (a small MLP trained here, seconds of CPU)

Each `act(steps, slots)` takes the envs' latest observations and gives (B, H, 4) action chunks in the
env's order (or None: the expert acts in the worker).
"""

from __future__ import annotations

import numpy as np
import torch

from loongforge.preprocess.samples.sim_env import ACTION_KEYS, STATE_KEYS, flat_action
from loongforge.shared.errors import ConfigError
from loongforge.train.eval.baselines import TrainingReference, ridge_fit, state_chunk_pairs

MLP_WIDTH, MLP_STEPS, MLP_BATCH, MLP_LR = 256, 3000, 256, 1e-3


class ExpertAgent:
    name, needs_frames = "expert", False

    def reset(self, slot: int, seed: int) -> None:
        pass

    def act(self, steps, slots):
        return None


class RandomAgent:
    name, needs_frames = "random", False

    def __init__(self, horizon: int):
        self.horizon, self.rngs = horizon, {}

    def reset(self, slot: int, seed: int) -> None:
        self.rngs[slot] = np.random.default_rng(seed)

    def act(self, steps, slots):
        return np.stack([self.rngs[s].uniform(-1, 1, (self.horizon, len(flat_action(_zeros())))) for s in slots])


def _zeros() -> dict:
    return {k: np.zeros(n, np.float32) for k, n in ACTION_KEYS.items()}


class PolicyAgent:
    """A served policy: anything with get_modality_config() and get_action(observation, options)."""

    needs_frames = True

    def __init__(self, policy, instruction: str, camera: str, *, name: str = "loongforge", options: dict | None = None):
        self.policy, self.instruction, self.name = policy, instruction, name
        self.options = dict(options or {})
        cfg = policy.get_modality_config()
        keys = lambda m: list(cfg[m]["modality_keys"])  # noqa: E731
        self.video, self.state, self.language = keys("video"), keys("state"), keys("language")[0]
        want = {"video": (self.video, [camera]), "state": (self.state, list(STATE_KEYS)),
                "action": (keys("action"), list(ACTION_KEYS))}
        for m, (got, have) in want.items():
            if sorted(got) != sorted(have):
                raise ConfigError(f"the policy reads {m} keys {got}; this env gives {have} (train on its "
                                  "demonstrations: loongforge sample-data --sim)")
        for m in ("video", "state"):
            if list(cfg[m]["delta_indices"]) != [0]:
                raise ConfigError(f"the policy's {m} delta indices are {cfg[m]['delta_indices']}; closed-loop rollouts "
                                  "give the current frame and state only ([0])")
        self.horizon = len(cfg["action"]["delta_indices"])

    def reset(self, slot: int, seed: int) -> None:
        pass

    def act(self, steps, slots):
        obs = {"video": {self.video[0]: np.stack([s.frame for s in steps])[:, None]},
               "state": {k: np.stack([s.state[k] for s in steps]).astype(np.float32)[:, None] for k in self.state},
               "language": {self.language: [[self.instruction] for _ in steps]}}
        action, _ = self.policy.get_action(obs, self.options)
        return flat_action(action)


class LocalPolicy:
    """The serve backend in this process: the same prepare + run `loongforge serve` calls per request."""

    def __init__(self, backend):
        self.backend = backend

    def get_modality_config(self) -> dict:
        return self.backend.get_modality_config()

    def get_action(self, observation: dict, options: dict | None = None):
        return self.backend.run(self.backend.prepare(observation, options))


class StateAgent:
    """Behaviour cloning from the state alone: `predict(x (B, S) processed state) -> (B, H, Da) processed`,
    decoded to robot units by the run's processor."""

    needs_frames = False

    def __init__(self, name: str, predict, processor, tag: str, horizon: int):
        self.name, self.predict, self.processor, self.tag, self.horizon = name, predict, processor, tag, horizon
        self.sa = processor.state_action(tag)

    def reset(self, slot: int, seed: int) -> None:
        pass

    def act(self, steps, slots):
        raw = {k: np.stack([s.state[k] for s in steps]).astype(np.float32)[:, None] for k in STATE_KEYS}
        x = self.sa.state(raw)[:, -1]
        return flat_action(self.processor.decode(self.predict(x), raw, self.tag))


def fit_state_agents(data, processor, tag: str, names=("state-ridge", "state-mlp"),
                     seed: int = 0) -> list[StateAgent]:
    """The state-only baselines fitted on the training episodes of `data` (training_data.TrainingData)."""
    x, y, _ = state_chunk_pairs(data, processor)
    h = data.roots[0].deltas.action_horizon
    out = []
    for name in names:
        if name == "state-ridge":
            predict = TrainingReference(ridge_fit(x, y), h, {}, (), len(x)).ridge  # the open-loop eval's ridge
        elif name == "state-mlp":
            predict = _fit_mlp(x, y, h, seed)
        else:
            raise ConfigError(f"baseline {name!r}: state-ridge or state-mlp")
        out.append(StateAgent(name, predict, processor, tag, h))
    return out


def _fit_mlp(x: np.ndarray, y: np.ndarray, h: int, seed: int):
    """A 2-hidden-layer MLP, x -> y by MSE, Adam, MLP_STEPS minibatches (seconds on a CPU)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(x.shape[1], MLP_WIDTH), nn.SiLU(), nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.SiLU(),
                        nn.Linear(MLP_WIDTH, y.shape[1]))
    opt = torch.optim.Adam(net.parameters(), lr=MLP_LR)
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    for _ in range(MLP_STEPS):
        idx = torch.randint(0, len(xt), (min(MLP_BATCH, len(xt)),), generator=g)
        loss = torch.nn.functional.mse_loss(net(xt[idx]), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()

    def predict(s: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return net(torch.from_numpy(np.asarray(s, np.float32))).numpy().reshape(len(s), h, -1)
    return predict
