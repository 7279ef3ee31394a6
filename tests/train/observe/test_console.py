"""The live console of a run (observe/metrics.py): samples/s from the steps' own times (records are
flushed in pairs before a checkpoint, microseconds apart), step N/total with an ETA and the last
validation metrics, an end-of-run summary; DeepSpeed's own per-step timer lines off by default."""

from __future__ import annotations

import argparse
import io
import re

import torch

from loongforge.train import flags
from loongforge.train.observe.metrics import MetricsLog
from loongforge.train.observe.profiler import LateWriter, StepTiming
from loongforge.train.parallel.engine import ds_config


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.0 - 0.1 * step, "samples": 8, "step_s": 0.5, "data_wait_s": 0.05,
            "warmup": step == 0, **extra}


def _log(tmp_path, total: int = 0) -> tuple[MetricsLog, io.StringIO]:
    out = io.StringIO()
    kw = {"total_steps": total} if total else {}
    return MetricsLog(str(tmp_path), enabled=True, resume=False, stream=out, **kw), out


def _timing() -> StepTiming:
    import inspect

    params = inspect.signature(StepTiming).parameters
    return StepTiming(**{name: None for name in params})


def test_samples_per_second_comes_from_the_steps_not_the_write_times(tmp_path, monkeypatch):
    """Two records flushed back to back (a checkpoint step): 8 samples in 0.5 s each is 16 samples/s."""
    from loongforge.train.observe import profiler

    monkeypatch.setattr(profiler.StepTimer, "finish", staticmethod(lambda timing: {}))
    log, out = _log(tmp_path)
    late = LateWriter(log.write)
    for step in range(4):
        late.push(_timing(), _record(step))
        if step % 2:
            late.flush()  # before a save: this record follows the previous one by microseconds
    late.flush()
    rates = [float(x) for x in re.findall(r"([\d.]+) samples/s", out.getvalue())]
    assert rates == [16.0] * 4, out.getvalue()


def test_progress_line_eta_val_metrics_and_summary(tmp_path):
    log, out = _log(tmp_path, total=4)
    for step in range(4):
        log.write(_record(step, **({"val_action_mse": 0.25, "val_flow_loss": 0.5} if step == 1 else {})))
    log.write_summary()
    lines = out.getvalue().splitlines()
    assert [re.match(r"step\s+(\d+)/4", x).group(1) for x in lines[:4]] == ["1", "2", "3", "4"]
    assert "ETA 1s" in lines[2] and "ETA" not in lines[3]  # 1 step left at 0.5 s/step
    assert "val_action_mse" not in lines[0] and all("val_action_mse 0.2500" in x for x in lines[1:4])
    assert lines[4].startswith("run summary: steps 1-4/4 in ") and "16.0 samples/s (steady)" in lines[4]
    assert "loss 2.0000 -> 1.7000" in lines[4] and "val_action_mse 0.2500" in lines[4]


def test_deepspeed_wall_clock_breakdown_is_off_by_default(tmp_path):
    p = argparse.ArgumentParser()
    flags.add_train_args(p)
    base = ["--data", str(tmp_path), "--run-dir", str(tmp_path / "run")]
    conf = ds_config(flags.config_from_args(p.parse_args(base)), world=1, device=torch.device("cpu"))
    assert conf["wall_clock_breakdown"] is False
    on = flags.config_from_args(p.parse_args([*base, "--ds-breakdown"]))
    assert ds_config(on, world=1, device=torch.device("cpu"))["wall_clock_breakdown"] is True
    assert flags.config_from_args(p.parse_args([*base, "--no-ds-breakdown"])).parallel.wall_clock_breakdown is False
