"""Where a step's time goes when a peer rank is late with its batch.

The trainer's rows all-reduce (`Trainer._loss_denominator`, every DP rank's valid action rows) is the first
collective of a step: a rank whose batch came early waits there for the slowest rank's batch. That
wait is data wait (the step cannot start before every rank has its data); it goes through no
deepspeed.comm timer, so outside the data phase it read as launch/dispatch overhead (the ablation's
row 0 at 2 ranks showed ~450 ms of "launch/dispatch" on the PyAV baseline). A narrow unit test: the
step's own body (`Trainer._one_step`) on stand-ins for the engine and the guards, with the rows
all-reduce replaced by a 0.3 s wait (a peer 0.3 s late)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from loongforge.train.observe.profiler import StepTimer
from loongforge.train.trainer import Trainer

PEER_LATE_S = 0.3


class _Engine:
    lr_scheduler = SimpleNamespace(get_last_lr=lambda: [1e-3])

    def __call__(self, batch, noise, t, rows):
        loss = (batch["action"].float() * 0).sum() + 1.0
        return {"loss": loss, "flow_loss": loss}

    def backward(self, loss):
        pass

    def step(self):
        pass

    def get_global_grad_norm(self):
        return 1.0


class _Processor:
    def draws(self, *args):
        return None

    def __call__(self, batch, tag, cameras, crop_u=None, draws=None):
        return dict(batch)


def _trainer() -> SimpleNamespace:
    tr = SimpleNamespace(
        engine=_Engine(), cfg=SimpleNamespace(parallel=SimpleNamespace(grad_accum=1), data=SimpleNamespace(seed=0)),
        policies=SimpleNamespace(on_step=lambda step: None, before_forward=lambda: None,
                                 set_sample_keys=lambda keys, device=None: None),
        watchdog=SimpleNamespace(phase=None), step_comm=SimpleNamespace(begin=lambda: None, end=lambda: {}),
        nan_guard=SimpleNamespace(observe=lambda step, loss: loss, step=lambda step: None, skipped=0),
        dp_sync=None, device=torch.device("cpu"), step=0, model_cfg=SimpleNamespace(max_action_dim=3, action_horizon=4),
        processor=_Processor(), index=SimpleNamespace(roots=[SimpleNamespace(tag="new_embodiment", cameras=())]))
    phases = []

    def late_peer_rows(batches):  # the all-reduce, waiting for a peer whose batch is 0.3 s late
        phases.append(tr.watchdog.phase)
        time.sleep(PEER_LATE_S)
        return torch.tensor(1.0)

    tr._loss_denominator = late_peer_rows
    tr._gather = lambda rec, losses, ids: rec
    tr.phases_at_rows = phases
    return tr


def test_a_late_peer_is_data_wait_not_overhead():
    tr = _trainer()
    batch = {"action": torch.zeros(2, 4, 3), "meta": {"sample_ids": np.array([0, 1]), "epoch": 0, "consumed": 0}}
    timer = StepTimer(torch.device("cpu"))
    timing, _ = Trainer._one_step(tr, iter([batch]), timer)
    rec = StepTimer.finish(timing)
    assert rec["data_wait_s"] >= PEER_LATE_S * 0.95, rec
    assert rec["overhead_s"] < PEER_LATE_S / 3, rec
    assert tr.phases_at_rows == ["step"]  # a hang in the all-reduce is a peer's, for the watchdog
