"""The learnable sample task (`loongforge sample-data OUT --task learnable`).

A visible target g_t (2-D) circles the origin at a fixed angular speed OMEGA, with a radius and
phase drawn per episode. Every state dimension j tracks its own projection of the target with a
first-order lag: s[t+1, j] = s[t, j] + GAIN[j] * (u_j . g_t - s[t, j]); the action row is where
the state goes next (a_t = s[t+1], as in real position-controlled datasets). The frames show g_t:
the background colour is a linear function of it (red ~ g_x, green ~ g_y, rotated per camera) and
a bright square sits at its position.

So (s_t, g_t) is the whole Markov state: the action chunk a_t .. a_{t+H-1} is an exact linear
function of the current state and of what the current frame shows (`chunk_from`), with fixed
coefficients per horizon step. The target moves half a turn per 16 frames and the state lags
behind it, so repeating the last action is poor; radius, phase and the initial state change per
episode, so predicting the mean action is poor too.
"""

from __future__ import annotations

import numpy as np

OMEGA = 2 * np.pi / 32  # rad per frame: half a turn over GR00T's 16-step horizon
CUE_GAIN = 100.0  # colour levels per unit of target


def _gains(dim: int) -> np.ndarray:
    return np.linspace(0.15, 0.45, dim)


def _directions(dim: int) -> np.ndarray:
    """(dim, 2) unit vectors: dimension j tracks u_j . g."""
    angles = np.arange(dim) * (np.pi / max(dim, 1)) * 1.5
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def target_path(n: int, radius: float, phase: float) -> np.ndarray:
    """(n, 2) target positions g_t."""
    a = OMEGA * np.arange(n) + phase
    return radius * np.stack([np.cos(a), np.sin(a)], axis=1)


def rollout(s0: np.ndarray, g0: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Run the dynamics from (s0, g0): states s_0..s_steps (steps+1, D), targets g_0..g_steps."""
    dim = len(s0)
    gains, dirs = _gains(dim), _directions(dim)
    rot = np.array([[np.cos(OMEGA), -np.sin(OMEGA)], [np.sin(OMEGA), np.cos(OMEGA)]])
    states, targets = [np.asarray(s0, np.float64)], [np.asarray(g0, np.float64)]
    for _ in range(steps):
        s, g = states[-1], targets[-1]
        states.append(s + gains * (dirs @ g - s))
        targets.append(rot @ g)
    return np.stack(states), np.stack(targets)


def chunk_from(state: np.ndarray, target: np.ndarray, horizon: int) -> np.ndarray:
    """The action chunk (horizon, D) that follows current state `state` and visible target `target`."""
    states, _ = rollout(state, target, horizon)
    return states[1:]


def learnable_episode(n: int, state_dim: int, action_dim: int, rng: np.random.Generator):
    """(state (n, Ds), action (n, Da), target (n, 2)) of one episode, float32 (target float64)."""
    dim = max(state_dim, action_dim)
    radius, phase = rng.uniform(0.4, 1.0), rng.uniform(0, 2 * np.pi)
    g = target_path(1, radius, phase)[0]
    s0 = rng.uniform(-1.0, 1.0, size=dim)
    states, targets = rollout(s0, g, n)
    state = states[:n, :state_dim].astype(np.float32)
    action = states[1 : n + 1, :action_dim].astype(np.float32)
    return state, action, targets[:n]


def learnable_frames(targets: np.ndarray, height: int, width: int, camera: int = 0) -> np.ndarray:
    """(n, h, w, 3) uint8 frames showing targets (n, 2): colour cue plus a square at the target."""
    turn = camera * np.pi / 3  # each camera sees the cue in its own colour axes
    rot = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    cue = targets @ rot.T
    n = len(targets)
    rgb = np.empty((n, height, width, 3), np.float32)
    rgb[..., 0] = 128 + CUE_GAIN * cue[:, 0, None, None]
    rgb[..., 1] = 128 + CUE_GAIN * cue[:, 1, None, None]
    rgb[..., 2] = 96
    side = max(4, height // 8)
    for i in range(n):  # per-frame (not per-pixel) loop: place the square
        y0 = int(round((height - side) * (0.5 - 0.45 * targets[i, 1])))
        x0 = int(round((width - side) * (0.5 + 0.45 * targets[i, 0])))
        rgb[i, y0 : y0 + side, x0 : x0 + side] = 240
    return np.clip(rgb, 0, 255).astype(np.uint8)


HAND_LEVELS = (1.5, 3.0)  # GR00T's Fourier hands: binary commands of +-1.5 or +-3 per joint
HAND_GAIN = 0.5  # the hand joint state moves this fraction of the way to the command per frame


def hands_episode(n: int, state_dim: int, action_dim: int, hand_dims: list[int], rng: np.random.Generator):
    """The learnable episode with `hand_dims` as binary commands (the `hands` task): command j is
    +-L_j by the side of the visible target on direction u_j (so it flips every half turn, at a
    moment the frames tell), L_j alternating 1.5 / 3; the hand state lags behind its command
    (joint positions vs commands, as GR00T's hands), the other dims are the learnable ones."""
    state, action, targets = learnable_episode(n, state_dim, action_dim, rng)
    dirs = _directions(max(state_dim, action_dim))
    for k, j in enumerate(hand_dims):
        level = HAND_LEVELS[k % len(HAND_LEVELS)]
        cmd = np.where(targets @ dirs[j] >= 0, level, -level).astype(np.float32)
        action[:, j] = cmd
        if j < state_dim:
            s = np.zeros(n, np.float32)
            for t in range(1, n):  # per-frame recurrence of one scalar, n ~ 100
                s[t] = s[t - 1] + HAND_GAIN * (cmd[t - 1] - s[t - 1])
            state[:, j] = s
    return state, action, targets
