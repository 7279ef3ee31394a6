"""`make gpu-check` / `bash infra/gpu/check.sh`: everything only a GPU can check, in one run with a
deadline (default 420 s, so that with the offline install of check.sh it ends inside 8 minutes on one
H200; estimated, not yet measured: no GPU has run it).

    loongforge bench gpu-check [--out results/gpu] [--shards DIR] [--steps 20] [--jobs 4] [--deadline 420]

Three parts, each with a share of the deadline (BUDGET); a part ends at its share or at the deadline,
whichever is first, and every process it starts gets at most the time its part has left, so the
parts can never add up to more than the whole. Time a part leaves unused goes to the next.
1. runs (first, on an idle GPU: they are measurements): a 20-step `tiny` and `small` run with
   --profile-steps, each followed by `loongforge profile --json`; `tiny` with --cuda-graphs (GPU
   idle inside the step before/after, `launch_overhead`) and with --zero 3 --grad-compression topk
   (hybrid sharding: the compressor's DP sync over a 1-rank NCCL group, counted as group "dp");
   they read the shard root of --shards (made by `make gpu-bundle`: no Beam or PyAV needed here)
   or one written on the spot;
2. serve: `loongforge bench serve --device cuda` (tiny and N1.6 full size, batch 1 and 8, 1 and 4
   clients); its N1.6 batch-1 row is one line of the summary, against the README's goal (p50 under
   50 ms with 4 flow steps);
3. tests: every CUDA-only test (`pytest -m gpu --collect-only` of the files that use the marker, so
   new tests join, and no file that needs the preprocess extras is imported),
   one pytest process per test file (a file's tests share its imports and fixtures: one NCCL
   group, one compile of each shape), `--jobs` files at a time, each test with its own pytest-timeout.
   A skipped GPU test is a failure, except the flash-attn tests when flash-attn does not import
   here (`skipped_parts`). A test of a process that died is "error"; one never started is "not run".
Every process shares one inductor/Triton cache (CACHE_DIR), so what `tiny` compiled in part 1 is
not compiled again, and a rerun on the same machine compiles nothing it compiled before.
Writes OUT/gpu-check-<date>.json after every part (what ran, passed, failed and was not reached; the
GPU, torch, CUDA) and OUT/gpu-check-<date>.txt (summary and profile tables). Exit 0 only if every
part ran and passed.
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
# Shares of --deadline, in the order the parts run (estimates: no GPU run yet).
BUDGET = {"runs": 0.40, "serve": 0.10, "tests": 0.50}
SERVE = ("--recipes", "tiny", "gr00t-n1.6", "--batches", "1", "8", "--clients", "1", "4", "--requests", "20")
SERVE_GOAL_MS = 50.0  # N1.6 full size, batch 1, 4 flow steps: get_action p50 (README, Deploy a policy)
SHARD_LENGTHS = (64,) * 4
CACHE_DIR = os.path.join(tempfile.gettempdir(), "loongforge-gpu-check-cache")
# Files whose tests launch training processes: started first, so the long ones do not start last.
SLOW_FIRST = ("test_ckpt_resilience", "test_deepspeed", "test_first_gpu_run", "test_precision")


def compile_cache_env(cache_dir: str = CACHE_DIR) -> dict:
    """One inductor and Triton cache for every process of the check (and its reruns on the machine)."""
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def _run(cmd: list[str], timeout: float, stdout_only: bool = False, **kw) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, seconds); `stdout_only` for a command whose stdout is a document
    (its log lines go to stderr and must not be parsed with it)."""
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DS_ACCELERATOR", None)  # a CPU override would hide the GPU
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, timeout), **kw)
        out = p.stdout if stdout_only and p.returncode == 0 else p.stdout + p.stderr
        return p.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        return 124, out + f"\n[gpu-check] timed out after {timeout:.0f} s", time.monotonic() - t0


class Part:
    """A part's time: it ends at `end` (monotonic), never past the whole check's deadline."""

    def __init__(self, name: str, end: float):
        self.name, self.end = name, end

    def left(self) -> float:
        return self.end - time.monotonic()

    def timeout(self, cap: float) -> float:
        return max(0.0, min(cap, self.left()))


def plan_parts(t0: float, deadline: float) -> dict[str, Part]:
    """Each part's end: its share after the previous parts' shares, capped by the deadline."""
    parts, at = {}, t0
    for name, share in BUDGET.items():
        at += share * deadline
        parts[name] = Part(name, min(at, t0 + deadline))
    return parts


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "python": sys.version.split()[0]}
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


def gpu_test_files(root: str = os.path.join(REPO, "tests")) -> list[str]:
    """The test files that use the gpu marker. Collecting the whole suite would import every test
    module, and those of preprocess (Beam, PyAV) cannot import on a GPU box that carries neither."""
    out = []
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.startswith("test_") and f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    if "mark.gpu" in fh.read():
                        out.append(os.path.relpath(os.path.join(d, f), REPO))
    return out


def collect_gpu_tests() -> tuple[list[str], str]:
    code, log, _ = _run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
                         "no:cacheprovider", *gpu_test_files()], 300)
    ids = [line.strip() for line in log.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]
    return ids, ("" if code == 0 else log[-4000:])


def groups_of(ids: list[str]) -> list[tuple[str, list[str]]]:
    """The tests by file, in collection order, the files that launch training first."""
    files: dict[str, list[str]] = {}
    for node in ids:
        files.setdefault(node.split("::", 1)[0], []).append(node)
    slow = lambda f: not any(s in f for s in SLOW_FIRST)  # noqa: E731
    return sorted(files.items(), key=lambda kv: slow(kv[0]))


def run_group(path: str, nodes: list[str], out_dir: str, timeout: float, test_timeout: float) -> list[dict]:
    """One pytest process for `nodes` (one file): pytest-timeout fails a test at `test_timeout` (the
    junit is still written); the process is killed at `timeout`. A node with no junit record is
    "error" if the process ended, "killed" if it was killed."""
    junit = os.path.join(out_dir, "junit-" + re.sub(r"[^\w.-]+", "_", path)[-150:] + ".xml")
    code, log, took = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"--timeout={max(1.0, min(test_timeout, timeout)):.0f}", f"--junitxml={junit}", *nodes],
                           timeout)
    seen: dict[str, dict] = {}
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            verdict = next((ch for ch in case if ch.tag in ("failure", "error", "skipped")), None)
            res = {"result": "passed" if verdict is None else verdict.tag, "seconds": float(case.get("time") or 0)}
            if verdict is not None:
                res["message"] = (verdict.get("message") or "")[:500]
            seen[case.get("name")] = res
        os.unlink(junit)
    out = []
    for node in nodes:
        res = {"name": node, **seen.get(node.split("::")[-1], {"result": "killed" if code == 124 else "error"})}
        if res["result"] not in ("passed", "skipped"):
            res["log_tail"] = log[-3000:]
        out.append(res)
    return out


def run_test(node: str, out_dir: str, timeout: float) -> dict:
    """One test in its own process (a group of one), with `timeout` for the test and the process."""
    return run_group(node.split("::", 1)[0], [node], out_dir, timeout + 60, timeout)[0]


def judge_tests(cases: list[dict], collect_error: str, flash: bool) -> dict:
    """The test part's verdict: every collected test passed; the only allowed skip is flash-attn's
    when it does not import here; nothing collected, or everything skipped, is a failure."""
    counts = {k: sum(c["result"] == k for c in cases)
              for k in ("passed", "failure", "error", "skipped", "killed", "not run")}
    allowed = [c["name"] for c in cases if c["result"] == "skipped" and not flash
               and FLASH_SKIP.search(c.get("message", "") + c["name"])]
    bad = [c["name"] for c in cases if c["result"] != "passed" and c["name"] not in allowed]
    ok = not collect_error and counts["passed"] > 0 and not bad
    return {"ok": ok, "tests": len(cases), **counts, "not_ok": bad, "cases": cases,
            "skipped_parts": [f"{n}: flash-attn is not installed (no wheel for this torch)" for n in allowed],
            **({"collect_error": collect_error} if collect_error else {})}


def gpu_tests(out_dir: str, test_timeout: float, part: Part, save, jobs: int = 1) -> dict:
    """The GPU tests, a file per process, `jobs` files at a time; the report is saved after each file.
    A file not started with a minute left in the part is "not run"."""
    ids, collect_error = collect_gpu_tests()
    flash, cases, lock = flash_attn_installed(), {}, threading.Lock()

    def one(group: tuple[str, list[str]]) -> None:
        path, nodes = group
        if part.left() < 60:
            res = [{"name": n, "result": "not run", "message": "gpu-check: the tests' time was used up"}
                   for n in nodes]
        else:
            res = run_group(path, nodes, out_dir, part.timeout(float("inf")), test_timeout)
        with lock:
            cases.update((r["name"], r) for r in res)
            save(judge_tests([cases[n] for n in ids if n in cases], collect_error, flash))

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(one, groups_of(ids)))
    return judge_tests([cases[n] for n in ids], collect_error, flash)


def write_shards(root: str) -> list[str]:
    """The shard root of the training runs (also written ahead by `make gpu-bundle`); returns its flags."""
    return synthetic_train_root(root, SHARD_LENGTHS, height=96, width=96, shard_size=1 << 22)


def train_run(recipe: str, data: str, work: str, steps: int, timeout: float, device: str = "cuda",
              extra: tuple[str, ...] = (), data_flags: tuple[str, ...] = ()) -> dict:
    """One training run and its profile, all within `timeout` seconds."""
    end = time.monotonic() + timeout
    label = _label(recipe, extra)
    run_dir = os.path.join(work, label)
    a, b = max(1, steps // 4), max(2, steps // 4 + 3)  # past warm-up (and graph recording), 3 traced steps
    code, log, took = _run([sys.executable, "-m", "loongforge.train", "--data", data, "--run-dir", run_dir,
                            "--recipe", recipe, "--steps", str(steps), "--batch-size", "16", "--workers", "2",
                            "--device", device, "--profile-steps", f"{a}:{b}", "--no-ds-breakdown", *data_flags,
                            *extra], timeout)
    res = {"recipe": label, "exit_code": code, "seconds": round(took, 1), "profile_steps": [a, b]}
    if code != 0:
        return {**res, "ok": False, "log_tail": log[-4000:]}
    pcode, pout, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--json", "--no-chart"],
                          min(120.0, end - time.monotonic()), stdout_only=True)
    tcode, table, _ = _run([sys.executable, "-m", "loongforge", "profile", run_dir, "--no-chart"],
                           min(120.0, end - time.monotonic()))
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
    p.add_argument("--shards", default=None,
                   help="the runs' shard root (the GPU bundle's); default: written into a temporary folder")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-tests", action="store_true",
                   help="only the training runs (for debugging them: the check then fails, its tests did not run)")
    p.add_argument("--test-timeout", type=float, default=240, help="seconds per GPU test (default 240)")
    p.add_argument("--jobs", type=int, default=4, help="test files run at once (default 4; 1 for a small GPU)")
    p.add_argument("--run-timeout", type=float, default=120, help="seconds per training run at most (default 120)")
    p.add_argument("--deadline", type=float, default=420,
                   help="seconds for the whole check; parts share it (BUDGET) and never run past it (default 420)")
    p.add_argument("--cache-dir", default=CACHE_DIR, help="the inductor/Triton cache every process shares")


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


def _label(recipe: str, extra: tuple[str, ...]) -> str:
    return recipe + "".join("+" + x[2:] if x.startswith("--") else "=" + x for x in extra)


def _runs(report: Report, a: argparse.Namespace, part: Part) -> None:
    plan = [("tiny", a.steps, ()), ("small", a.steps, ()), ("tiny", a.steps, ("--cuda-graphs",)),
            ("tiny", min(a.steps, 10), TOPK)]
    with tempfile.TemporaryDirectory(prefix="loongforge-gpu-check-") as work:
        data = a.shards or os.path.join(work, "shards")
        flags = tuple(write_shards(data))  # a root already there (the bundle's) is read as it is
        for recipe, steps, extra in plan:
            if part.left() < 30:
                report.data["runs"].append({"recipe": _label(recipe, extra), "ok": False, "not_run": True,
                                            "problems": ["not run: the runs' time was used up"]})
            else:
                report.data["runs"].append(train_run(recipe, data, work, steps, part.timeout(a.run_timeout),
                                                     extra=extra, data_flags=flags))
            report.save()
    runs = report.data["runs"]
    report.data["launch_overhead"] = launch_overhead(runs[0], runs[2])


def serve_latency(out_dir: str, part: Part) -> dict:
    """`loongforge bench serve` on the GPU; its N1.6 batch-1 single-client row as one summary line."""
    if part.left() < 20:
        return {"ok": False, "not_run": True, "problems": ["not run: the serve part's time was used up"]}
    code, out, took = _run([sys.executable, "-m", "loongforge", "bench", "serve", "--device", "cuda", *SERVE,
                            "--out", os.path.join(out_dir, "serve"), "--json"], part.timeout(600), stdout_only=True)
    if code != 0:
        return {"ok": False, "seconds": round(took, 1), "problems": [f"bench serve exited {code}"],
                "log_tail": out[-4000:]}
    doc = json.loads(out)
    r = next(r for r in doc["rows"] if r["recipe"] == "gr00t-n1.6" and r["batch"] == 1 and r["clients"] == 1)
    s = r["server_ms"]
    met = r["p50_ms"] < SERVE_GOAL_MS
    line = (f"serve, N1.6 full size, B=1, 1 client, 4 flow steps, 1 sample, float32 on {doc['gpu']}: get_action p50 "
            f"{r['p50_ms']:.1f} / p95 {r['p95_ms']:.1f} / p99 {r['p99_ms']:.1f} ms (goal p50 < {SERVE_GOAL_MS:.0f} ms: "
            f"{'met' if met else 'NOT met'}); server: decode+preprocess {s['decode'] + s['preprocess']:.1f}, model "
            f"{s['model']:.1f}, encode {s['encode']:.1f} ms")
    return {"ok": True, "seconds": round(took, 1), "line": line, "goal_met": met, "bench": doc}


def handle(a: argparse.Namespace) -> int:
    env = environment()
    if not env["cuda_available"]:
        print(f"gpu-check: torch {env['torch']} sees no CUDA device (torch.version.cuda={env['cuda']}). On a GPU "
              "box: `bash infra/gpu/check.sh` (offline, the image's torch) or `make gpu-check` (README, GPU "
              "check).", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    os.environ.update(compile_cache_env(a.cache_dir))  # inherited by every process below
    report = Report(a.out, env)
    parts = plan_parts(report.t0, a.deadline)
    report.data["budget_s"] = {"deadline": a.deadline, **{n: round(p.end - report.t0, 1) for n, p in parts.items()}}
    try:
        report.save()
        _runs(report, a, parts["runs"])
        report.save()
        report.data["serve"] = serve_latency(a.out, parts["serve"])
        report.save()
        if a.skip_tests:
            report.data["tests"] = {"ok": False, "skipped_by_flag": True}
        else:
            report.data["tests"] = gpu_tests(a.out, a.test_timeout, parts["tests"],
                                             lambda part: (report.data.update(tests=part), report.save()), a.jobs)
        d = report.data
        d["ok"] = (d["tests"]["ok"] and all(r["ok"] for r in d["runs"]) and d["launch_overhead"]["ok"]
                   and d["serve"]["ok"])
        d["finished"] = True
    finally:
        report.save()
    _print_summary(report)
    return 0 if report.data["ok"] else 1


def tally(d: dict) -> dict:
    """ran / passed / failed / not reached, of the tests and of the runs."""
    cases = (d.get("tests") or {}).get("cases", [])
    runs = d.get("runs", [])
    not_run = [c for c in cases if c["result"] == "not run"]
    return {"tests": {"collected": len(cases), "ran": len(cases) - len(not_run),
                      "passed": sum(c["result"] == "passed" for c in cases),
                      "failed": sum(c["result"] not in ("passed", "not run") for c in cases),
                      "not_reached": len(not_run)},
            "runs": {"planned": len(runs), "ran": sum(not r.get("not_run") for r in runs),
                     "passed": sum(bool(r["ok"]) for r in runs),
                     "failed": sum(not r["ok"] and not r.get("not_run") for r in runs),
                     "not_reached": sum(bool(r.get("not_run")) for r in runs)}}


def _print_summary(report: Report) -> None:
    d = report.data
    d["tally"] = tally(d)
    report.save()
    lines = []
    for r in d["runs"]:
        lines.append(f"== {r['recipe']}: {'ok' if r['ok'] else 'FAILED'} in {r.get('seconds')} s {r.get('problems') or ''}")
        lines.append(r.get("table") or r.get("log_tail", ""))
    lo = d.get("launch_overhead") or {}
    if lo.get("ok"):
        lines.append("launch overhead (GPU idle in the step, not data wait), tiny, ms/step: eager "
                     f"{lo['eager']['launch_overhead_s'] * 1e3:.2f} of {lo['eager']['step_s'] * 1e3:.2f}, --cuda-graphs "
                     f"{lo['cuda_graphs']['launch_overhead_s'] * 1e3:.2f} of {lo['cuda_graphs']['step_s'] * 1e3:.2f}")
    sv = d.get("serve") or {}
    lines.append(sv.get("line") or f"serve: FAILED {sv.get('problems') or ''}\n{sv.get('log_tail', '')[-1500:]}")
    t = d.get("tests") or {}
    for c in t.get("cases", []):
        if c["name"] in t.get("not_ok", []):
            lines.append(f"  {c['result']}: {c['name']} {c.get('message', '')}\n{c.get('log_tail', '')[-1500:]}")
    for part in t.get("skipped_parts", []):
        lines.append(f"  skipped (explicitly): {part}")
    for what, n in d["tally"].items():
        lines.append(f"gpu-check {what}: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in n.items()))
    lines.append(f"gpu-check {'passed' if d['ok'] else 'FAILED'} in {d['seconds']} s (deadline "
                 f"{d['budget_s']['deadline']:.0f} s): {report.base}.json, {report.base}.txt")
    text = "\n".join(lines)
    with open(report.base + ".txt", "w") as f:
        f.write(text + "\n")
    print(text)
