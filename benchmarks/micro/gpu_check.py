"""`make gpu-check`: everything only a GPU can check, in one run (its time on one H200 is
unmeasured: no GPU has run it yet; the Makefile target installs the CUDA torch first).

    loongforge bench gpu-check [--out results/gpu] [--steps 20] [--test-timeout 360] [--jobs 4] [--deadline 540]

1. every CUDA-only test (`pytest -m gpu --collect-only`: the marker, not a list, so new GPU tests
   join), each in its own pytest process with its own budget (`--test-timeout`; the tests start
   training subprocesses with 240-300 s timeouts) and its own junit file, so a test that hangs or
   is killed costs only its own result. A skipped test is a failure (on a GPU box "needs CUDA"
   means the check did not check), except the flash-attn tests when flash-attn is not installed
   (no wheel for this torch): reported in `skipped_parts`, not silently;
2. a 20-step `tiny` and a 20-step `small` run on one GPU with --profile-steps, each followed by
   `loongforge profile --json` (trace-based breakdown: exposed comm, launch overhead, ...); and
   `tiny` with --zero 3 --grad-compression topk (hybrid sharding: the compressor's DP sync over a
   1-rank NCCL group, each step, counted as group "dp" in the metrics);
3. the `tiny` run again with --cuda-graphs (train/kernels/graphs.py): GPU idle inside the step (no kernel
   on any stream, data wait excluded: the trace's launch overhead) before/after, in `launch_overhead`;
4. writes OUT/gpu-check-<date>.json after every part (so a run cut short still leaves what it
   did: tests, every breakdown, the GPU, torch, CUDA) and OUT/gpu-check-<date>.txt (the profile
   tables). A part not started before `--deadline` seconds is "not run", a failure. Exit 0 only
   if every part that must run ran and passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import xml.etree.ElementTree as ET

from loongforge.benchmarks.harness.dataset import synthetic_train_root
from loongforge.benchmarks.harness.report import RESULTS_DIR, SOURCE_CHECKOUT
from loongforge.train.parallel.engine import fused_adam_prebuilt

REPO = str(SOURCE_CHECKOUT)
RECIPES = ("tiny", "small")
TOPK = ("--zero", "3", "--grad-compression", "topk")  # train/parallel/compression.py on NCCL


def _run(cmd: list[str], timeout: float, **kw) -> tuple[int, str, float]:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DS_ACCELERATOR", None)  # a CPU override would hide the GPU
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kw)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        return 124, out + f"\n[gpu-check] timed out after {timeout:.0f} s", time.monotonic() - t0


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if env["cuda_available"]:
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return env


FLASH_SKIP = re.compile(r"flash.?attn", re.I)  # the one skip allowed: flash-attn not installed


def flash_attn_installed() -> bool:
    """Importable, not merely present: a flash-attn wheel built for another torch is found on the path
    (find_spec) but fails to import (undefined symbols in its CUDA extension), so its tests skip; that
    skip is allowed only when flash-attn cannot be used here, which is what this must then say."""
    try:
        importlib.import_module("flash_attn")  # optional extra loongforge[gpu]
    except (ImportError, OSError):
        return False
    return True


def collect_gpu_tests() -> tuple[list[str], str]:
    code, log, _ = _run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
                         "no:cacheprovider", "tests"], 300)
    ids = [line.strip() for line in log.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]
    return ids, ("" if code == 0 else log[-4000:])


def run_test(node: str, out_dir: str, timeout: float) -> dict:
    """One GPU test in its own pytest process: pytest-timeout fails it at `timeout` (the junit is
    still written); the process is killed 60 s later if even that hangs."""
    junit = os.path.join(out_dir, "junit-" + re.sub(r"[^\w.-]+", "_", node)[-150:] + ".xml")
    code, log, took = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout:.0f}",
                            f"--junitxml={junit}", node], timeout + 60)
    res = {"name": node, "exit_code": code, "seconds": round(took, 1), "result": "killed" if code == 124 else "error"}
    if os.path.exists(junit):
        case = next(ET.parse(junit).getroot().iter("testcase"), None)
        if case is not None:
            verdict = next((ch for ch in case if ch.tag in ("failure", "error", "skipped")), None)
            res["result"] = "passed" if verdict is None else verdict.tag
            if verdict is not None:
                res["message"] = (verdict.get("message") or "")[:500]
        os.unlink(junit)
    if res["result"] not in ("passed", "skipped"):
        res["log_tail"] = log[-4000:]
    return res


def judge_tests(cases: list[dict], collect_error: str, flash: bool) -> dict:
    """The test part's verdict: every collected test passed; the only allowed skip is flash-attn's
    when it is not installed; nothing collected, or everything skipped, is a failure."""
    counts = {k: sum(c["result"] == k for c in cases) for k in ("passed", "failure", "error", "skipped", "killed")}
    allowed = [c["name"] for c in cases if c["result"] == "skipped" and not flash
               and FLASH_SKIP.search(c.get("message", "") + c["name"])]
    bad = [c["name"] for c in cases if c["result"] != "passed" and c["name"] not in allowed]
    ok = not collect_error and counts["passed"] > 0 and not bad
    return {"ok": ok, "tests": len(cases), **counts, "not_ok": bad, "cases": cases,
            "skipped_parts": [f"{n}: flash-attn is not installed (no wheel for this torch)" for n in allowed],
            **({"collect_error": collect_error} if collect_error else {})}


def gpu_tests(out_dir: str, test_timeout: float, deadline: float, save, jobs: int = 1) -> dict:
    """The GPU tests, `jobs` at a time (each is a process that mostly waits on its training
    subprocess; one H200 holds several), in collection order; the report is saved after each."""
    ids, collect_error = collect_gpu_tests()
    flash, cases, lock = flash_attn_installed(), {}, threading.Lock()

    def one(node: str) -> None:
        left = deadline - time.monotonic()
        if left < 60:
            res = {"name": node, "result": "not run", "message": "gpu-check deadline reached"}
        else:
            res = run_test(node, out_dir, min(test_timeout, left))
        with lock:
            cases[node] = res
            save(judge_tests([cases[n] for n in ids if n in cases], collect_error, flash))

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(one, ids))
    return judge_tests([cases[n] for n in ids], collect_error, flash)


def train_run(recipe: str, data: str, work: str, steps: int, timeout: float, device: str = "cuda",
              extra: tuple[str, ...] = (), data_flags: tuple[str, ...] = ()) -> dict:
    label = recipe + "".join("+" + x[2:] if x.startswith("--") else "=" + x for x in extra)
    run_dir = os.path.join(work, label)
    a, b = max(1, steps // 4), max(2, steps // 4 + 3)  # past warm-up (and graph recording), 3 traced steps
    code, log, took = _run([sys.executable, "-m", "loongforge.train", "--data", data, "--run-dir", run_dir,
                            "--recipe", recipe, "--steps", str(steps), "--batch-size", "16", "--workers", "2",
                            "--device", device, "--profile-steps", f"{a}:{b}", "--no-ds-breakdown", *data_flags,
                            *extra], timeout)
    res = {"recipe": label, "exit_code": code, "seconds": round(took, 1), "profile_steps": [a, b]}
    if code != 0:
        return {**res, "ok": False, "log_tail": log[-4000:]}
    pcode, pout, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--json", "--no-chart"], 120)
    tcode, table, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--no-chart"], 120)
    with open(os.path.join(run_dir, "ds_config.json")) as f:
        optimizer = json.load(f)["optimizer"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, filter(str.strip, f)) if "step" in m]
    timers = sorted({m.get("timer") for m in steps} - {None})
    problems = []
    if "topk" in extra and not all("dp" in (m.get("comm_groups") or {}) for m in steps):
        problems.append("--grad-compression topk: a step without the compressor's DP sync (no 'dp' comm group)")
    if pcode or tcode:
        problems.append(f"loongforge profile failed: {(pout + table)[-2000:]}")

    if not optimizer["params"].get("torch_adam") and not fused_adam_prebuilt():
        problems.append(f"optimizer {optimizer} would need a DeepSpeed op build")
    if "cuda_events" not in timers:
        problems.append(f"metrics timers {timers}: no CUDA-event timing")
    breakdown = json.loads(pout) if pcode == 0 else None
    if breakdown is not None and not any(t["kind"] == "gpu" for t in breakdown["traces"]):
        problems.append("the profile has no GPU trace (no kernels recorded)")
    return {**res, "ok": not problems, "problems": problems, "optimizer": optimizer, "timers": timers,
            "breakdown": breakdown, "table": table if tcode == 0 else None}


def idle_per_step(run: dict) -> dict | None:
    """Mean seconds per traced step of a run's GPU trace: step, GPU idle (no kernel on any stream),
    and its launch-overhead part (idle while the host is not waiting on data)."""
    traces = [t for t in ((run.get("breakdown") or {}).get("traces") or []) if t["kind"] == "gpu"]
    if not traces:
        return None
    t = traces[0]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"step_s": mean(t["step_s"]), "gpu_idle_s": mean(t["gpu_idle_s"]),
            "launch_overhead_s": mean(t["launch_overhead_s"])}


def launch_overhead(eager: dict, graphed: dict) -> dict:
    """Before/after --cuda-graphs on the same recipe and data: the seed's "kernel launch and
    scheduling" slice, measured as GPU idle inside the step that is not data wait."""
    before, after = idle_per_step(eager), idle_per_step(graphed)
    res = {"eager": before, "cuda_graphs": after, "ok": before is not None and after is not None}
    if res["ok"]:
        for k in ("launch_overhead_s", "step_s"):
            res[f"{k}_ratio"] = after[k] / before[k] if before[k] else None
        res["launch_overhead_share"] = {"eager": before["launch_overhead_s"] / before["step_s"],
                                        "cuda_graphs": after["launch_overhead_s"] / after["step_s"]}
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.path.join(str(RESULTS_DIR), "gpu"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-tests", action="store_true",
                   help="only the training runs (for debugging them: the check then fails, its tests did not run)")
    p.add_argument("--test-timeout", type=float, default=360, help="seconds per GPU test (default 360)")
    p.add_argument("--jobs", type=int, default=4, help="GPU tests run at once (default 4; 1 for a small GPU)")
    p.add_argument("--run-timeout", type=float, default=240, help="seconds per training run (default 240)")
    p.add_argument("--deadline", type=float, default=540,
                   help="seconds after which no new part starts; those not started fail (default 540)")


class Report:
    """The JSON report, rewritten after every part so a run cut short still leaves its results."""

    def __init__(self, out: str, env: dict):
        self.stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
        self.base = os.path.join(out, f"gpu-check-{self.stamp}")
        self.t0 = time.monotonic()
        self.data = {"started": self.stamp, "environment": env, "runs": [], "ok": False, "finished": False,
                     "flash_attn_installed": flash_attn_installed()}

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 1)
        tmp = self.base + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.base + ".json")


def _runs(report: Report, a: argparse.Namespace, deadline: float) -> None:
    plan = [(r, a.steps, ()) for r in RECIPES]
    plan += [("tiny", a.steps, ("--cuda-graphs",)), ("tiny", min(a.steps, 10), TOPK)]
    with tempfile.TemporaryDirectory(prefix="loongforge-gpu-check-") as work:
        data = os.path.join(work, "shards")
        flags = tuple(synthetic_train_root(data, (64,) * 4, height=96, width=96, shard_size=1 << 22))
        for recipe, steps, extra in plan:
            if deadline - time.monotonic() < 30:
                label = recipe + "".join("+" + x[2:] for x in extra if x.startswith("--"))
                report.data["runs"].append({"recipe": label, "ok": False, "problems": ["not run: deadline reached"]})
            else:
                left = deadline - time.monotonic() + a.run_timeout / 2  # a started run may finish past it
                report.data["runs"].append(train_run(recipe, data, work, steps, min(a.run_timeout, left),
                                                     extra=extra, data_flags=flags))
            report.save()
    runs = report.data["runs"]
    report.data["launch_overhead"] = launch_overhead(runs[0], runs[2])


def handle(a: argparse.Namespace) -> int:
    env = environment()
    if not env["cuda_available"]:
        print(f"gpu-check: torch {env['torch']} sees no CUDA device (torch.version.cuda={env['cuda']}). On a GPU "
              "box: `make gpu-check` installs the CUDA build (see README, GPU check).", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    report = Report(a.out, env)
    deadline = report.t0 + a.deadline
    try:
        report.save()
        if a.skip_tests:
            report.data["tests"] = {"ok": False, "skipped_by_flag": True}
        else:
            report.data["tests"] = gpu_tests(a.out, a.test_timeout, deadline,
                                             lambda part: (report.data.update(tests=part), report.save()), a.jobs)
        report.save()
        _runs(report, a, deadline)
        d = report.data
        d["ok"] = d["tests"]["ok"] and all(r["ok"] for r in d["runs"]) and d["launch_overhead"]["ok"]
        d["finished"] = True
    finally:
        report.save()
    _print_summary(report)
    return 0 if report.data["ok"] else 1


def _print_summary(report: Report) -> None:
    d = report.data
    with open(report.base + ".txt", "w") as f:
        f.write("\n\n".join(f"== {r['recipe']} ==\n{r.get('table') or r.get('log_tail', '')}" for r in d["runs"]))
    for r in d["runs"]:
        print(f"== {r['recipe']}: {'ok' if r['ok'] else 'FAILED'} in {r.get('seconds')} s {r.get('problems') or ''}")
        print(r.get("table") or r.get("log_tail", ""))
    lo = d["launch_overhead"]
    if lo["ok"]:
        print("launch overhead (GPU idle in the step, not data wait), tiny, ms/step: eager "
              f"{lo['eager']['launch_overhead_s'] * 1e3:.2f} of {lo['eager']['step_s'] * 1e3:.2f}, --cuda-graphs "
              f"{lo['cuda_graphs']['launch_overhead_s'] * 1e3:.2f} of {lo['cuda_graphs']['step_s'] * 1e3:.2f}")
    t = d["tests"]
    counts = {k: t.get(k) for k in ("tests", "passed", "failure", "error", "skipped", "killed")}
    print(f"gpu tests: {'ok' if t['ok'] else 'FAILED'} {json.dumps(counts)}")
    for c in t.get("cases", []):
        if c["name"] in t.get("not_ok", []):
            print(f"  {c['result']}: {c['name']} {c.get('message', '')}\n{c.get('log_tail', '')[-1500:]}")
    for part in t.get("skipped_parts", []):
        print(f"  skipped (explicitly): {part}")
    print(f"gpu-check {'passed' if d['ok'] else 'FAILED'} in {d['seconds']} s: {report.base}.json, {report.base}.txt")
