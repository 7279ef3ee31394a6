"""`loongforge bench closed-loop`: the whole chain on a simulated task, one command, the commands a user runs:

    demonstrations   loongforge sample-data --sim metaworld:TASK --episodes N  (the scripted expert, seeds 0..)
    transcode        loongforge preprocess --val-count V                        (held-out episodes for open loop)
    train            loongforge train --recipe tiny-sim --steps S --batch-size B --zero 0  (from scratch, 1 rank)
    open loop        loongforge eval RUN --data SHARDS                          (8-sample mean vs ridge, repeat-last)
    closed loop      loongforge eval RUN --env metaworld:TASK --episodes E      (policy, expert, random, state BC)

Each stage's wall and CPU seconds (its process tree's user + system, from the OS's accounting of
children) and the load average before and after go to results/closed-loop-<task>-<time>.{json,md},
with the closed-loop table, its plot and the first rollouts' mp4s beside them. The training budget is
CPU seconds (`--steps` x the recipe's step on one core): a busy machine stretches the wall clock, not
the CPU time. `--quick`: 3 demonstrations, 40 steps, 3 rollouts of at most 100 steps (minutes): the chain, not
the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from loongforge.benchmarks.harness.report import RESULTS_DIR


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _stage(name: str, argv: list[str], log: str, stages: dict) -> str:
    """Run one `loongforge` command; its wall and CPU seconds into `stages`; its output tail on failure."""
    print(f"closed-loop bench: {name}: loongforge {' '.join(argv)}", file=sys.stderr, flush=True)
    t, c = time.perf_counter(), _cpu()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "loongforge", *argv], stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stages[name] = {"wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(_cpu() - c, 1), "argv": argv,
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    text = open(log).read()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); the end of {log}:\n{text[-3000:]}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="button-press-topdown-v3", help="Meta-World task (button-press-topdown-v3)")
    p.add_argument("--demos", type=int, default=50, help="expert demonstrations (50)")
    p.add_argument("--val-count", type=int, default=5, help="of them held out for the open-loop eval (5)")
    p.add_argument("--recipe", default="tiny-sim")
    p.add_argument("--steps", type=int, default=6000, help="training steps (6000)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--episodes", type=int, default=50, help="closed-loop rollouts on unseen seeds (50)")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--action-steps", type=int, default=16, help="steps of each predicted chunk executed before the "
                   "policy looks again (16, the whole chunk: chosen on validation seeds, train/README.md \"A recipe "
                   "that learns\")")
    p.add_argument("--samples", type=int, default=None, help="flow samples per chunk (default: the eval's 8)")
    p.add_argument("--max-steps", type=int, default=None, help="rollout step limit (default: the task's)")
    p.add_argument("--quick", action="store_true", help="3 demos, 40 steps, 3 rollouts of at most 100 steps: the "
                   "chain only")
    p.add_argument("--workdir", default=None, help="keep demos, shards and the run here (default: a temp dir)")
    p.add_argument("--out", default=RESULTS_DIR)


def handle(a: argparse.Namespace) -> int:
    if a.quick:
        a.demos, a.val_count, a.steps, a.batch_size, a.episodes = 3, 1, 40, 8, 3
        a.max_steps = a.max_steps or 100
    env = f"metaworld:{a.task}"
    work = a.workdir or tempfile.mkdtemp(prefix="lf-closed-loop-")
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    demos, shards, run = (os.path.join(work, n) for n in ("demos", "shards", "run"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(a.out, f"closed-loop-{a.task}-{stamp}")
    os.makedirs(out, exist_ok=True)
    doc = {"task": env, "load_avg_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "started": stamp, "args": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                                      for k, v in vars(a).items() if k != "func"}, "stages": {}}
    st = doc["stages"]
    _stage("demonstrations", ["sample-data", "--sim", env, "--episodes", str(a.demos), demos],
           os.path.join(work, "demos.log"), st)
    doc["demonstrations"] = json.load(open(os.path.join(demos, "meta", "sim.json")))
    _stage("preprocess", ["preprocess", "--input", demos, "--output", shards, "--val-count", str(a.val_count),
                          "--workers", "1"], os.path.join(work, "preprocess.log"), st)
    _stage("train", ["train", "--data", shards, "--run-dir", run, "--recipe", a.recipe, "--steps", str(a.steps),
                     "--batch-size", str(a.batch_size), "--zero", "0", "--save-every", str(a.steps),
                     "--log-every", str(max(1, a.steps // 20))], os.path.join(work, "train.log"), st)
    text = _stage("open-loop eval", ["eval", run, "--data", shards, "--out", os.path.join(out, "open_loop")],
                  os.path.join(work, "openloop.log"), st)
    doc["open_loop"] = json.load(open(os.path.join(out, "open_loop", "eval.json"))).get("errors")
    doc["open_loop_table"] = text[text.find("MSE"):text.find("summary:")].strip()
    argv = ["eval", run, "--env", env, "--data", shards, "--episodes", str(a.episodes), "--num-envs",
            str(a.num_envs), "--action-steps", str(a.action_steps), "--out", os.path.join(out, "closed_loop")]
    argv += ["--samples", str(a.samples)] if a.samples else []
    argv += ["--max-steps", str(a.max_steps)] if a.max_steps else []
    text = _stage("closed-loop eval", argv, os.path.join(work, "closedloop.log"), st)
    doc["closed_loop"] = json.load(open(os.path.join(out, "closed_loop", "closed_loop.json")))
    doc["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    table = text[text.find("closed loop:"):text.find("summary:")].strip()
    md = _markdown(doc, table)
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"results: {out}.json, {out}.md, {out}/ (plot, videos)")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _markdown(doc: dict, table: str) -> str:
    st, d = doc["stages"], doc["demonstrations"]
    rows = "\n".join(f"| {n} | {s['wall_s']} | {s['cpu_s']} | {s['load_avg_after'][0]} |" for n, s in st.items())
    agents = {r["agent"]: r for r in doc["closed_loop"]["agents"]}
    policy = agents.get("loongforge")
    rate = f"{100 * policy['success_rate']:.0f}%" if policy else "-"
    return "\n".join([
        f"# closed loop: {doc['task']}",
        "",
        f"demonstrations: {d['episodes']} expert episodes kept, {d['failed']} failed; rendering "
        f"{d['render_frames_per_s']} frames/s at {d['size']} px ({d['camera']})",
        f"load average before {doc['load_avg_before']} (1/5/15 min), after {doc['load_avg_after']}; {doc['cpus']} CPUs",
        f"the policy: {rate} success",
        "",
        table,
        "",
        "open loop on the held-out demonstrations (dataset units):",
        "",
        "```",
        doc["open_loop_table"],
        "```",
        "",
        "| stage | wall s | CPU s | load after |",
        "|---|---|---|---|",
        rows,
        "",
    ])
