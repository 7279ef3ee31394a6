"""Launch a short real training job at a given world size and summarise what it measured.

`loongforge tune buckets` (train/tune/buckets.py) and `loongforge bench scale`
(benchmarks/scale/run.py) both run the trainer itself, under torchrun, on gloo
(--device cpu) or NCCL, and read its metrics.jsonl: per step the wall time,
DeepSpeed's own collective time, and the per-group counter (`comm_groups`: calls,
payload and wire bytes this rank sent, host seconds inside collectives; rank 0's).

Exposed communication: on gloo every collective blocks the host, so the host seconds
inside collectives are the exposed communication (waiting for a slower peer included).
On CUDA those seconds are launch time only; the exposed/overlapped split comes from the
profiler trace (`--profile-steps`, `loongforge profile`), which `summarise` reads when present.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from loongforge.shared.errors import ConfigError, LoongForgeError
from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.observe.breakdown import comm_by_group


@dataclass(frozen=True, slots=True)
class JobResult:
    world: int
    args: tuple[str, ...]
    steps: int  # timed steps (the first step of the process is left out: warm-up)
    step_s: float  # median wall time per step
    comm_s: float  # median host seconds inside collectives per step (all groups)
    compute_s: float  # step_s - comm_s
    groups: dict = field(default_factory=dict)  # {kind: {calls, payload_bytes, wire_bytes, seconds}} per step
    loss_last: float = float("nan")

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def wire_bytes(self) -> float:
        return sum(g["wire_bytes"] for g in self.groups.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "args": list(self.args), "comm_share": self.comm_share, "wire_bytes": self.wire_bytes}


def synthetic_data(workdir: str, samples: int = 64) -> str:
    """A small shard root (2 cameras, 4 episodes of samples // 4 frames, one shard each) for jobs
    without --data; written once per workdir."""
    root = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(root, "index.json")):
        make_synthetic_root(root, lengths=(max(1, samples // 4),) * 4, shard_size=1)
    return root


def _env() -> dict:
    # The device is the trainer's --device; DeepSpeed follows it (engine.align_ds_accelerator).
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")


def run_job(world: int, args: list[str], *, data: str, run_dir: str, device: str = "cpu",
            timeout_s: float = 900) -> JobResult:
    """One trainer launch (torchrun, `world` local ranks); raises LoongForgeError with the log tail
    when it fails or runs past `timeout_s`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "loongforge.train", "--data", data, "--run-dir", run_dir, "--device", device, *args]
    log_path = os.path.join(run_dir, "launch.log")
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise LoongForgeError(f"job on {world} ranks ({' '.join(args)}) failed ({rc}); log {log_path}:\n{tail}")
    return summarise(run_dir, world, args)


def summarise(run_dir: str, world: int, args) -> JobResult:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    use = [r for r in rows if "step_s" in r and not r.get("warmup")]
    if not use:
        raise ConfigError(f"{run_dir}: no timed step after warm-up; run at least 2 steps")
    comm = [sum(g["seconds"] for g in r.get("comm_groups", {}).values()) for r in use]
    step = statistics.median(r["step_s"] for r in use)
    comm_s = statistics.median(comm)
    return JobResult(world=world, args=tuple(args), steps=len(use), step_s=step, comm_s=comm_s,
                     compute_s=max(step - comm_s, 0.0), groups=comm_by_group(use), loss_last=use[-1]["loss"])


def plan_args(spec: str) -> tuple[dict, list[str]]:
    """"dp" | "tp=2,sp=2[,zero=3][,compress=3]" -> (the plan as a dict, the trainer flags)."""
    plan = {"tp": 1, "sp": 1, "zero": 2, "compress": 0.0}
    if spec.strip() not in ("", "dp"):
        for part in spec.split(","):
            key, _, val = part.partition("=")
            if key.strip() not in plan or not val:
                raise ConfigError(f"--plan {spec!r}: write dp or key=value pairs of tp, sp, zero, compress "
                                  "(e.g. tp=2,sp=2,zero=3)")
            plan[key.strip()] = float(val) if key.strip() == "compress" else int(val)
    flags = ["--tp", str(plan["tp"]), "--sp", str(plan["sp"]), "--zero", str(plan["zero"])]
    if plan["compress"]:
        flags += ["--grad-compression", "topk", "--compress-ratio", str(plan["compress"])]
    return plan, flags


def plan_name(plan: dict) -> str:
    parts = [f"tp{plan['tp']}" if plan["tp"] > 1 else "", f"sp{plan['sp']}" if plan["sp"] > 1 else "",
             f"zero{plan['zero']}", f"topk{plan['compress']:g}" if plan["compress"] else ""]
    return "-".join(p for p in parts if p) if plan["tp"] * plan["sp"] > 1 else "dp-" + "-".join(p for p in parts if p)
