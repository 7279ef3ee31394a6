"""The open-loop eval's baselines, on a hand-made episode (narrow fakes of the policy and the
validation batches: the arithmetic of the baselines is what is checked)."""

from types import SimpleNamespace

import numpy as np
import torch
from loongforge.train.eval.openloop import evaluate_episode


def test_repeat_last_holds_the_last_action_never_the_state():
    # two chunks of H = 2, state and action of the same width (as GR00T's hand joints vs commands)
    actions = torch.tensor([[[1.0, 1.0], [2.0, 2.0]], [[3.0, 3.0], [4.0, 4.0]]])
    batch = {"action": actions, "raw_action": actions, "action_valid": torch.ones(2, 2, dtype=torch.bool),
             "state": torch.full((2, 1, 2), -50.0), "raw_state": torch.full((2, 1, 2), -50.0),
             "frame_mask": torch.ones(2, 1, dtype=torch.bool)}
    # decoding is the identity here: values in robot units
    policy = SimpleNamespace(flows=lambda b, tag, cams, steps, seed, n: np.zeros((n, *b["action"].shape), np.float32),
                             decode_concat=lambda a, raw, tag=None: np.asarray(a, np.float32),
                             processor=SimpleNamespace(state_action=lambda tag: SimpleNamespace(action_dim=2)))
    traj = evaluate_episode(policy, SimpleNamespace(batches=[batch], tag="new_embodiment", cameras=("front",)))
    # first chunk: the command in effect at the start (action 0); second: the last action before it
    assert traj["repeat_last"][:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert traj["truth"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
