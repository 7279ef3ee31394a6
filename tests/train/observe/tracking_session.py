"""One launch's tracker, as the trainer drives it (test_tracking.py runs it as a process and may SIGKILL it):
`python tracking_session.py RUN_DIR REPORT_TO START STOP OFFSET [--resume] [--save-at S] [--hang]`.

A real Tracker and MetricsLog (rank 0) get synthetic rows for steps START..STOP-1, loss 1/(step+1) + OFFSET
(a re-run after a resume gives other values, so a test can tell which launch a value came from);
`--save-at S` calls the tracker's save hook before step S, `--hang` prints HUNG and waits to be killed."""

from __future__ import annotations

import argparse
import os
import sys
import time

from loongforge.train.config import DataConfig, RunConfig, TrackConfig, TrainConfig
from loongforge.train.observe.metrics import MetricsLog
from loongforge.train.observe.tracking import Tracker


def row(step: int, offset: float) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1) + offset, "flow_loss": 0.5 + offset,
            "lr": 1e-3 * (step + 1), "grad_norm": 2.0 + step, "samples": 8, "step_s": 0.2 + 0.01 * step,
            "data_wait_s": 0.01, "comm_s": 0.02, "overhead_s": 0.03, "compute_s": 0.14 + 0.01 * step,
            "nonfinite_skips": 0, "bad_samples": 0, "world": 2}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("report_to")
    p.add_argument("start", type=int)
    p.add_argument("stop", type=int)
    p.add_argument("offset", type=float)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--hang", action="store_true")
    a = p.parse_args()
    names = () if a.report_to == "none" else tuple(a.report_to.split(","))
    cfg = TrainConfig(data=DataConfig(root="unused"), run=RunConfig(run_dir=a.run_dir, resume=a.resume),
                      track=TrackConfig(report_to=names))
    tracker = Tracker.for_training(cfg, rank=0, start_step=a.start)
    metrics = MetricsLog(a.run_dir, enabled=True, resume=a.resume, keep_below=a.start, sinks=(tracker,),
                         stream=open(os.devnull, "w"))
    for step in range(a.start, a.stop):
        if step == a.save_at:
            tracker.on_save(1.5)
            metrics.write({**row(step, a.offset), "save_s": 0.5})
        else:
            metrics.write(row(step, a.offset))
    if a.hang:
        print("HUNG", flush=True)
        time.sleep(600)
    tracker.close()
    metrics.close()


if __name__ == "__main__":
    sys.exit(main())
