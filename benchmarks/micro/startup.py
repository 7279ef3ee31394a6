"""Time to first step: where a launch's start-up goes, and how long a restart after a rank's SIGKILL
leaves the job without a step. Same machine, same minute, one invocation:

    loongforge bench startup [--repeats 3] [--no-restart] [--out results]

Rows, each the median of `--repeats` runs interleaved with the baseline (so load hits both alike):
* `import torch`: a bare `python -c "import torch"`, process start to exit: the unit of the goal;
* `floor`: `python -c "import torch, deepspeed, loongforge.train.model.hf, os; os._exit(0)"`: the
  libraries every rank imports whatever it trains (the engine, transformers' Qwen3/SigLIP2 blocks the
  model is built from), nothing of LoongForge's own, and the exit a run takes (os._exit: no interpreter
  teardown, ~1 s with these modules loaded); what a run costs beyond it is LoongForge's own start-up;
* `1 rank`: `loongforge train` of the `tiny` recipe for 1 step (CPU), process start to exit;
* `2 ranks`: the same under `torchrun --nproc_per_node 2`;
* `restart`: `loongforge train --elastic` on 2 ranks; after step 3 rank 1 is SIGKILLed; from the kill
  to the end of the relaunch's first step (on the surviving rank, the checkpoint converted to 1 rank).

The split of a launch comes from rank 0's first step record (`startup` in metrics.jsonl: the trainer's
start-up phases on the wall clock, from the process's own start, train/resilience/startup.py):
imports (interpreter, imports, parsing: everything before the trainer), data open (the shard index
in preflight, the decode workers), model build, DeepSpeed init (process group, engine), resume, the
first step (its batch included), and `after` (the final checkpoint, teardown, exit) from the wall
time. A restart adds, before the relaunched rank's own phases: detect (the kill -> the supervisor's
fault record: the peer's failed collective, torchrun's teardown), plan (-> the launch record: the
checkpoint converted to the new rank count) and launch (-> the new rank's process start: the
launcher's start and its rendezvous).

Goals (ratios that hold on any machine): the whole 1-rank run <= 2.5x `import torch`; restart <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loongforge.benchmarks.harness.report import RESULTS_DIR, machine_info, write_timestamped
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.resilience.owner import rank_pid

VENV_BIN = Path(sys.executable).parent
TRAIN_LENGTHS = (20, 12, 18, 14)  # 64 samples, 8 global batches of 8 (the trainer tests' root)
RUN_FLAGS = ["--recipe", "tiny", "--batch-size", "8", "--seed", "1", "--no-ds-breakdown"]
GOAL_RATIO, GOAL_RESTART_S = 2.5, 5.0
# The split's columns, from the trainer's phase names (startup.py marks): summed where several map to one.
COLUMNS = {"imports": ("imports",), "data open": ("preflight", "loader"), "model build": ("build_model",),
           "DeepSpeed init": ("setup", "init_distributed", "parallelize"), "resume": ("resume",),
           "first step": ("first step",)}


def _env() -> dict:
    # A CPU benchmark: GPUs hidden, so the trainer and DeepSpeed both pick the CPU by themselves.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(cmd: list[str], log: Path, timeout: float) -> float:
    """Wall seconds of `cmd`, from just before its process starts to its exit; raises on failure."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return wall


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def split(startup: dict) -> dict:
    """The trainer's phases (seconds) folded into the benchmark's columns."""
    phases = startup["phases_s"]
    return {col: round(sum(phases.get(p, 0.0) for p in names), 3) for col, names in COLUMNS.items()}


def one_launch(root: str, work: Path, name: str, ranks: int, timeout: float) -> dict:
    """A 1-step tiny run on `ranks` ranks: wall time, and rank 0's split with `after` (step -> exit)."""
    run_dir = str(work / name)
    train = ["--data", root, "--run-dir", run_dir, "--steps", "1", *RUN_FLAGS]
    if ranks == 1:
        cmd = [str(VENV_BIN / "loongforge"), "train", *train]
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(_port()),
               "-m", "loongforge.train", *train]
    t_start = time.time()
    wall = _timed(cmd, work / f"{name}.log", timeout)
    first = next(r for r in _rows(run_dir) if "startup" in r)["startup"]
    cols = split(first)
    cols["after"] = round(t_start + wall - first["first_step_end"], 3)
    return {"wall_s": round(wall, 3), "split_s": cols}


def import_torch(work: Path, timeout: float) -> float:
    return _timed([sys.executable, "-c", "import torch"], work / "import-torch.log", timeout)


FLOOR = "import torch, deepspeed, loongforge.train.model.hf, os; os._exit(0)"


def import_floor(work: Path, timeout: float) -> float:
    return _timed([sys.executable, "-c", FLOOR], work / "import-floor.log", timeout)


def restart(root: str, work: Path, name: str, timeout: float, kill_after: int = 3, steps: int = 8) -> dict:
    """2 ranks under the elastic supervisor; rank 1 SIGKILLed after step `kill_after`; kill -> next step."""
    run_dir, log, capacity = str(work / name), work / f"{name}.log", work / f"{name}.capacity"
    cmd = [str(VENV_BIN / "loongforge"), "train", "--elastic", "--min-ranks", "1", "--max-ranks", "2",
           "--capacity-file", str(capacity), "--data", root, "--run-dir", run_dir,
           "--steps", str(steps), "--save-every", "2", "--heartbeat-s", "0.5", *RUN_FLAGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:  # after `kill_after` steps, with a checkpoint behind them (save every 2)
                rows = _rows(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
                if len([r for r in rows if "step" in r]) >= kill_after and (pid := rank_pid(run_dir, 1)):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"restart run: no {kill_after} steps (exit {proc.poll()}):\n"
                                       f"{log.read_text()[-3000:]}")
                time.sleep(0.05)
            capacity.write_text("1")  # its slot is gone with it: go on with the survivor
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"restart run exited {rc}:\n{log.read_text()[-3000:]}")
    rows = _rows(run_dir)
    events = [r for r in rows if r.get("event") == "elastic" and r["t"] >= t_kill]
    fault = next(r for r in events if r["action"] == "fault")
    launch = next(r for r in events if r["action"] == "launch")
    first = next(r["startup"] for r in rows if "startup" in r and r["startup"]["process_start"] > t_kill)
    cols = {"detect": round(fault["t"] - t_kill, 3), "plan": round(launch["t"] - fault["t"], 3),
            "launch": round(first["process_start"] - launch["t"], 3), **split(first)}
    return {"restart_s": round(first["first_step_end"] - t_kill, 3), "split_s": cols, "killed_after_step": kill_after}


def _median(runs: list[dict], key: str) -> dict:
    """The median run by `key` (its split goes with it: the columns of one real run, not of several)."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="lf-startup-bench-") as tmp:
        work = Path(tmp)
        root = str(work / "root")
        make_synthetic_root(root, lengths=TRAIN_LENGTHS, shard_size=1, action_horizon=1)
        # Warm the page cache and every on-disk cache (numba's, .pyc) once, untimed: the figures are warm starts.
        one_launch(root, work, "warm", 1, args.timeout)
        torch_s, floor_s, one, two = [], [], [], []
        for i in range(args.repeats):  # interleaved: the baseline is measured in the same minute as each run
            torch_s.append(import_torch(work, args.timeout))
            floor_s.append(import_floor(work, args.timeout))
            one.append(one_launch(root, work, f"one{i}", 1, args.timeout))
            torch_s.append(import_torch(work, args.timeout))
            two.append(one_launch(root, work, f"two{i}", 2, args.timeout))
        rest = [restart(root, work, f"restart{i}", args.timeout) for i in range(args.repeats)] if args.restart else []
    base = statistics.median(torch_s)
    floor = statistics.median(floor_s)
    doc = {"benchmark": "startup", "import_torch_s": {"median": round(base, 3), "runs": [round(t, 3) for t in torch_s]},
           "floor_s": {"command": FLOOR, "median": round(floor, 3), "runs": [round(t, 3) for t in floor_s],
                       "x_import_torch": round(floor / base, 2)},
           "one_rank": {**_median(one, "wall_s"), "runs": one}, "two_ranks": {**_median(two, "wall_s"), "runs": two}}
    doc["one_rank"]["x_import_torch"] = round(doc["one_rank"]["wall_s"] / base, 2)
    doc["two_ranks"]["x_import_torch"] = round(doc["two_ranks"]["wall_s"] / base, 2)
    if rest:
        doc["restart"] = {**_median(rest, "restart_s"), "runs": rest}
    doc["goals"] = {"one_rank_x_import_torch": {"goal": GOAL_RATIO, "measured": doc["one_rank"]["x_import_torch"],
                                                "met": doc["one_rank"]["x_import_torch"] <= GOAL_RATIO}}
    if rest:
        doc["goals"]["restart_s"] = {"goal": GOAL_RESTART_S, "measured": doc["restart"]["restart_s"],
                                     "met": doc["restart"]["restart_s"] <= GOAL_RESTART_S}
    return doc


def table(doc: dict) -> str:
    cols = [*COLUMNS, "after"]
    lines = ["| row | wall (s) | / import torch | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
    base = doc["import_torch_s"]["median"]
    lines.append(f"| import torch (bare) | {base:.2f} | 1.00x |" + " |" * len(cols))
    f = doc["floor_s"]
    lines.append(f"| floor: import torch, deepspeed, transformers' blocks | {f['median']:.2f} | "
                 f"{f['x_import_torch']:.2f}x |" + " |" * len(cols))
    for key, name in (("one_rank", "tiny, 1 step, 1 rank"), ("two_ranks", "tiny, 1 step, 2 ranks (torchrun)")):
        r = doc[key]
        lines.append(f"| {name} | {r['wall_s']:.2f} | {r['x_import_torch']:.2f}x | "
                     + " | ".join(f"{r['split_s'][c]:.2f}" for c in cols) + " |")
    out = "\n".join(lines)
    if "restart" in doc:
        r = doc["restart"]
        rcols = ["detect", "plan", "launch", *COLUMNS]
        out += ("\n\n| restart | kill -> next step (s) | " + " | ".join(rcols) + " |\n" + "|---" * (len(rcols) + 2)
                + f"|\n| rank 1 of 2 SIGKILLed after step {r['killed_after_step']}, relaunched on 1 | "
                f"{r['restart_s']:.2f} | " + " | ".join(f"{r['split_s'][c]:.2f}" for c in rcols) + " |")
    for name, g in doc["goals"].items():
        unit = "x import torch" if name.startswith("one_rank") else "s"
        out += (f"\ngoal {name}: <= {g['goal']} {unit}: measured {g['measured']} {unit}: "
                + ("met" if g["met"] else "MISSED"))
        if name.startswith("one_rank"):
            out += f" (the floor alone: {doc['floor_s']['x_import_torch']} x import torch)"
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, help="runs per row (median reported)")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="skip the restart row")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each run")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"results folder (default {RESULTS_DIR})")


def handle(args: argparse.Namespace) -> int:
    info = machine_info()
    doc = measure(args)
    doc.update(args={k: v for k, v in vars(args).items() if not callable(v)}, machine=info,
               load_average_end=list(os.getloadavg()))
    print(table(doc))
    print(f"load average (1/5/15 min): {info['load_average_start']} at start, {doc['load_average_end']} at the end")
    write_timestamped(args.out, "startup", doc)
    return 0
