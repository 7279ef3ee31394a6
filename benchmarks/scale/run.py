"""`loongforge bench scale`: the same training job at 1, 2, 4, 8 ranks (gloo, tiny recipe), then a
calibrated alpha-beta projection to 32, 64 and 128 GPUs.

  loongforge bench scale --ranks 1,2,4,8 --plan dp --plan tp=2,sp=2

Weak scaling: every data-parallel replica trains `--micro-batch` samples per step, so the work
per replica is fixed and what grows with the rank count is communication. Each (plan, size)
is one real trainer launch (train/tune/jobs.py); a size the plan does not divide
(world % (tp*sp)) is listed as skipped. Measured per step: wall time, host seconds inside
collectives (gloo blocks: exposed comm), comm share, bytes this rank sent by group kind.
Projected (benchmarks/scale/alpha_beta.py): comm time and share at 32/64/128 GPUs from the fitted
bytes per group and the NVLink / InfiniBand inputs; sizes whose share passes 30% are flagged.
Writes results/scale-<date>.json and .png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import tempfile
from pathlib import Path

from loongforge.benchmarks.harness.dataset import TRAIN_DELTAS, synthetic_train_root
from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.benchmarks.scale import alpha_beta as ab
from loongforge.train.tune import jobs
from loongforge.train.config import DataConfig, RunConfig, TrainConfig
from loongforge.train.data.training_data import load_training_data
from loongforge.train.model.model import Gr00tN1d6, count_parameters
from loongforge.train.parallel.tensor_parallel import TP_PLAN, tp_modules
from loongforge.train.recipes import plan_model
from loongforge.benchmarks.scale.report import plot as draw, tables

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
SEED_COMPUTE_S = 4.15 - 1.29  # the practitioner's 32-GPU N1.6 step minus its comm: GPU compute per step


def scale_data(workdir: str, samples: int) -> tuple[str, list[str]]:
    """(root, extra trainer flags) of a small synthetic shard root: episodes of 16 frames,
    16x16, 2 cameras, read with 2 frames per camera; written once per workdir."""
    root = os.path.join(workdir, "data")
    return root, synthetic_train_root(root, (16,) * -(-samples // 16))


def measure(ranks, plans, *, recipe: str, steps: int, micro_batch: int, workdir: str, device: str) -> list[dict]:
    data, data_flags = scale_data(workdir, max(64, 4 * micro_batch * max(ranks)))
    rows = []
    for spec in plans:
        plan, flags = jobs.plan_args(spec)
        name = jobs.plan_name(plan)
        for n in ranks:
            if n % (plan["tp"] * plan["sp"]):
                rows.append({"plan_name": name, "plan": plan, "world": n, "status": "skipped: world % (tp*sp) != 0"})
                continue
            dp = n // (plan["tp"] * plan["sp"])
            args = [*flags, "--recipe", recipe, "--steps", str(steps), "--batch-size", str(micro_batch * dp),
                    "--seed", "1", "--no-ds-breakdown", *data_flags]
            res = jobs.run_job(n, args, data=data, run_dir=os.path.join(workdir, f"{name}-{n}"), device=device)
            log.info("%s at %d ranks: step %.1f ms, comm %.1f%%, %.3f MB sent per rank", name, n, res.step_s * 1e3,
                     100 * res.comm_share, res.wire_bytes / 1e6)
            rows.append({"plan_name": name, "plan": plan, "status": "ok", **res.to_dict()})
    return rows


def _split_params(model) -> int:
    """Elements TP shards: the weights (and column biases) of every linear of the TP plan."""
    n = 0
    for _, mod in tp_modules(model):
        for path, kind in TP_PLAN[type(mod).__name__]:
            if kind == "sum":
                continue
            lin = mod
            for part in path.split("."):
                lin = lin[int(part)] if part.isdigit() else getattr(lin, part)
            n += lin.weight.numel() + (lin.bias.numel() if kind == "col" and lin.bias is not None else 0)
    return n


def recipe_sizes(measured: str, target: str, workdir: str) -> dict:
    """Parameters (all, and TP-split) and activation size of the measured and the target recipe (both
    GR00T N1.6, the target typically the released size), on the measured data layout."""
    import torch

    root = os.path.join(workdir, "data")
    index = load_training_data(DataConfig(root=root, video_deltas=TRAIN_DELTAS))
    out = {}
    for role, name in (("measured", measured), ("target", target)):
        plan = plan_model(TrainConfig(recipe=name, data=DataConfig(root=root, video_deltas=TRAIN_DELTAS),
                                      run=RunConfig(run_dir=workdir)), index)
        c = plan.model
        with torch.device("meta"):
            model = Gr00tN1d6(c)
        images = len(index.dataset.cameras) * index.max_frames
        per_image = c.tokens_per_image(*plan.processor.cfg.image_size)
        patches = per_image * (c.pixels_per_token // c.vision.patch_size) ** 2
        act = (c.vision.hidden_size * c.vision.num_hidden_layers * images * patches
               + c.text.hidden_size * c.select_layer * plan.prompts[0].length
               + c.dit.inner_dim * c.dit.num_layers * (1 + index.dataset.action_horizon))
        out[role] = {"recipe": name, "params": count_parameters(model), "tp_split_params": _split_params(model),
                     "act": act, "prompt_tokens": plan.prompts[0].length, "image_tokens": images * per_image}
    return out


def byte_scale(sizes: dict, plan: dict, dtype_bytes: int) -> dict:
    """Multipliers from the measured (fp32) bytes to the target's (dtype_bytes): ZeRO moves the
    parameters one TP rank holds, TP/SP move trunk activations. NOTE: the projection holds the global
    batch per GPU fixed across plans (so compute per rank is the same input for every plan): a
    replica of T*S ranks then trains T*S times the measured samples per replica, and its activation
    traffic grows by T*S."""
    held = lambda r: r["params"] - r["tp_split_params"] * (plan["tp"] - 1) / plan["tp"]  # noqa: E731
    m, t = sizes["measured"], sizes["target"]
    dtype = dtype_bytes / 4
    return {"param": dtype * held(t) / held(m), "act": dtype * t["act"] / m["act"] * plan["tp"] * plan["sp"]}


def analyse(rows: list[dict], *, hw: ab.Hardware, sizes, compute_s: float, recipes: dict, dtype_bytes: int) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    link = [(g["calls"], g["wire_bytes"], g["seconds"]) for r in ok for g in r["groups"].values()]
    alpha, beta = ab.fit_link(link)
    for r in ok:  # how well calls*alpha + bytes*beta explains the measured comm time
        r["model_comm_s"] = sum(g["calls"] * alpha + g["wire_bytes"] * beta for g in r["groups"].values())
    plans = {}
    for name in dict.fromkeys(r["plan_name"] for r in ok):
        mine = [r for r in ok if r["plan_name"] == name]
        plan, fit = mine[0]["plan"], ab.fit_plan(mine)
        scale = byte_scale(recipes, plan, dtype_bytes)
        plans[name] = {"plan": plan, "fit": fit, "byte_scale": scale,
                       "projection": [ab.project(fit, plan, n, hw, compute_s, scale) for n in sizes
                                      if n % (plan["tp"] * plan["sp"]) == 0]}
    return {"link_fit": {"alpha_s": alpha, "beta_s_per_byte": beta,
                         "bandwidth_mb_s": (1 / beta / 1e6) if beta else None}, "plans": plans}


def reproject(doc: dict, *, hw: ab.Hardware, sizes, compute_s: float, dtype_bytes: int) -> dict:
    """The projection of an earlier run's measured rows with other inputs (no new measurement)."""
    doc = dict(doc, projection_inputs={**doc["projection_inputs"], "hardware": hw.to_dict(), "sizes": list(sizes),
                                       "compute_s_per_step": compute_s, "dtype_bytes": dtype_bytes})
    doc.update(analyse(doc["measured"], hw=hw, sizes=sizes, compute_s=compute_s,
                       recipes=doc["projection_inputs"]["recipes"], dtype_bytes=dtype_bytes))
    return doc


def run(ranks, plans, *, recipe="tiny", steps=4, micro_batch=2, device="cpu", out_dir: Path = RESULTS_DIR,
        hw=ab.Hardware(), sizes=(32, 64, 128), project_recipe="gr00t-n1.6", compute_s=SEED_COMPUTE_S, dtype_bytes=2,
        workdir=None, plot=True) -> tuple:
    with tempfile.TemporaryDirectory(prefix="loongforge-scale-") as tmp:
        work = workdir or tmp
        rows = measure(ranks, plans, recipe=recipe, steps=steps, micro_batch=micro_batch, workdir=work,
                       device=device)
        sizes_of = recipe_sizes(recipe, project_recipe, work)
    doc = {"version": FORMAT_VERSION, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": device, "recipe": recipe, "steps": steps, "data": f"synthetic shard root, video deltas "
           f"{TRAIN_DELTAS}",
           "micro_batch_per_replica": micro_batch,
           "load_avg": os.getloadavg()[0], "measured": rows,
           "projection_inputs": {"hardware": hw.to_dict(), "recipe": project_recipe, "recipes": sizes_of,
                                 "compute_s_per_step": compute_s, "dtype_bytes": dtype_bytes,
                                 "sizes": list(sizes)},
           **analyse(rows, hw=hw, sizes=sizes, compute_s=compute_s, recipes=sizes_of, dtype_bytes=dtype_bytes)}
    return doc, save(doc, out_dir / f"scale-{dt.date.today():%Y%m%d}.json", plot)


def save(doc: dict, path: Path, plot: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    if plot:
        draw(doc, path.with_suffix(".png"))
    return path


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated counts, e.g. 1,2,4,8") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 1")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=_ints, default=(1, 2, 4, 8), help="rank counts to run (default 1,2,4,8)")
    p.add_argument("--plan", action="append", help="dp or tp=T,sp=S[,zero=Z][,compress=R]; repeat to compare "
                                                   "(default: dp and tp=2,sp=2)")
    p.add_argument("--recipe", default="tiny", help="recipe the jobs train (default tiny)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per data-parallel replica per step")
    p.add_argument("--steps", type=int, default=4, help="steps per job (the first is warm-up)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--project-to", type=_ints, default=(32, 64, 128), help="GPU counts to project to")
    p.add_argument("--project-recipe", default="gr00t-n1.6", help="recipe whose bytes the projection scales to (the released N1.6)")
    p.add_argument("--compute-s", type=float, default=SEED_COMPUTE_S, help="GPU compute seconds per step at the "
                   "projected sizes (default 2.86: the practitioner's N1.6 4.15 s step minus its 1.29 s comm on 32 GPUs)")
    p.add_argument("--nvlink-gbps", type=float, default=150.0, help="achieved NVLink GB/s per GPU")
    p.add_argument("--nvlink-latency-us", type=float, default=5.0)
    p.add_argument("--ib-gbps", type=float, default=40.0, help="achieved InfiniBand GB/s per GPU")
    p.add_argument("--ib-latency-us", type=float, default=10.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--from-json", type=Path, default=None, help="re-project an earlier scale JSON with these "
                   "inputs (no new measurement); writes <name>-reprojected.json/.png beside it")
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4), help="bytes per element on the GPUs "
                   "(2: bf16, as the trainer on CUDA; the gloo runs measure fp32)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--workdir", type=Path, help="keep the synthetic root and the run directories here")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def handle(args: argparse.Namespace) -> int:
    hw = ab.Hardware(gpus_per_node=args.gpus_per_node, nvlink_gbps=args.nvlink_gbps,
                     nvlink_latency_us=args.nvlink_latency_us, ib_gbps=args.ib_gbps, ib_latency_us=args.ib_latency_us)
    if args.from_json:
        doc = reproject(json.loads(args.from_json.read_text()), hw=hw, sizes=args.project_to,
                        compute_s=args.compute_s, dtype_bytes=args.dtype_bytes)
        path = save(doc, args.from_json.with_name(args.from_json.stem + "-reprojected.json"), plot=not args.no_plot)
        print(tables(doc))
        print(f"\nresults: {path}")
        return 0
    doc, path = run(args.ranks, args.plan or ["dp", "tp=2,sp=2"], recipe=args.recipe, steps=args.steps,
                    micro_batch=args.micro_batch, device=args.device, out_dir=args.out, hw=hw, sizes=args.project_to,
                    project_recipe=args.project_recipe, compute_s=args.compute_s, dtype_bytes=args.dtype_bytes,
                    workdir=str(args.workdir) if args.workdir else None, plot=not args.no_plot)
    print(tables(doc))
    print(f"\nresults: {path}" + ("" if args.no_plot else f" (plot: {path.with_suffix('.png')})"))
    return 0
