"""`loongforge bench memory`: GPU memory per rank of GR00T N1.6 (the released 2.96 B architecture by
default) by parallel layout, from the real model, without a GPU.

  loongforge bench memory [--recipe gr00t-n1.6] [--micro-batch 8] [--images 2] [--ac-every 0 1]

Model states, per rank, exactly from the model's parameter table (built on the meta device) and the
plan's rules: every parameter in bf16 (DeepSpeed's bf16 mode); for each trainable parameter a bf16
gradient and fp32 master weight + Adam's two moments (12 bytes); TP divides the parameters of its plan
(train/parallel/tensor_parallel.py TP_PLAN) by tp; ZeRO-1 partitions the 12 bytes, ZeRO-2 the
gradients too, ZeRO-3 the parameters too, over the shard group (sp x dp ranks). Two fine-tuning
set-ups: N1.6's defaults (vision tower and LLM layers below the top 4 frozen: 517 of 1,105 tensors
train) and everything trainable.

Activations, per sample: what autograd saves for backward in one real forward of the model at its
full size, counted under FakeTensorMode (shapes and dtypes only: no memory, no compute),
deduplicated by storage, parameters excluded, with activation checkpointing applied as the trainer
applies it (--ac-every N), at N1.6's token counts (the chat prompt and --images images of 252 x 252,
81 tokens each). Per layout the backbone's saved bytes are divided by tp x sp (TP splits the heads
and MLP widths, SP the video tokens) and the action head's by tp: an estimate (the replicated norms
and residual streams do not split), said so in the table's note. Writes results/memory-<recipe>.json.
"""

from __future__ import annotations

import argparse
import json
import os

from loongforge.benchmarks.harness.report import RESULTS_DIR
from loongforge.train.kernels.checkpointing import apply_ac
from loongforge.train.model.model import Gr00tN1d6
from loongforge.train.parallel.tensor_parallel import TP_PLAN, tp_modules
from loongforge.train.recipes import recipe as make

GB = 1e9
# Where a saved tensor is attributed: the modules forward() is called on (the action head's encoders and
# its DiT; ActionHead's own methods are plain calls).
TOWERS = ("backbone.model.vision_model", "backbone.model.language_model.model", "backbone.model.mlp1",
          "action_head.model", "action_head.state_encoder", "action_head.action_encoder", "action_head.action_decoder")
BACKBONE = TOWERS[:3]
DEFAULT_LAYOUTS = ("1x1x32", "2x1x16", "2x2x8", "2x4x4", "4x2x4", "8x1x4")  # tp x sp x dp on 32 GPUs


def _layout(text: str) -> tuple[int, int, int]:
    t, s, d = (int(x) for x in text.split("x"))
    return t, s, d


def param_table(cfg) -> dict:
    """name -> (numel, tp_split, trainable_by_default) of the model on the meta device."""
    import torch


    with torch.device("meta"):
        model = Gr00tN1d6(cfg)
    split = set()
    for prefix, mod in tp_modules(model):
        for path, kind in TP_PLAN[type(mod).__name__]:
            if kind == "sum":
                continue
            split.add(f"{prefix}.{path}.weight")
            if kind == "col":
                split.add(f"{prefix}.{path}.bias")
    return {n: (p.numel(), n in split, p.requires_grad) for n, p in model.named_parameters()}


def model_states(table: dict, *, tp: int, shard: int, zero: int, everything: bool) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state; under ZeRO-3 also the largest module
    gathered whole for its forward (N1.6: the LLM's 310 M-parameter embedding table, never TP-split)."""
    held = lambda n, split: n / tp if split else n  # noqa: E731
    params = sum(2 * held(n, s) for n, s, _ in table.values())
    train = sum(held(n, s) for n, s, t in table.values() if t or everything)
    grads, opt = 2 * train, 12 * train
    gather = 0.0
    if zero >= 1:
        opt /= shard
    if zero >= 2:
        grads /= shard
    if zero >= 3:
        params /= shard
        modules: dict = {}
        for name, (n, s, _) in table.items():
            owner = name.rsplit(".", 1)[0]
            modules[owner] = modules.get(owner, 0) + 2 * held(n, s)
        gather = max(modules.values())
    return {"params": params, "grads": grads, "optimizer": opt, "gathered": gather}


def activations(cfg, *, images: int, ac_every: int, everything: bool, micro_batch: int = 1) -> dict:
    """Bytes autograd saves per micro-batch, by tower, from a FakeTensorMode forward at full size."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode


    side = 252
    per_image = (side // cfg.pixels_per_token) ** 2
    prompt = 60 + images * (per_image + 8)  # the template and task (~60 tokens), each image's markers
    h, a, s = cfg.action_horizon, cfg.max_action_dim, cfg.max_state_dim
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Gr00tN1d6(cfg if not everything else cfg.replace(tune_llm=True, tune_visual=True), "sdpa")
        finally:
            torch.set_default_dtype(torch.float32)
        apply_ac(model, ac_every)
        b = micro_batch
        ids = torch.full((b, prompt), 5, dtype=torch.long)
        ids[:, 40:40 + images * per_image] = cfg.image_token_index
        inputs = {"pixel_values": torch.randn(b * images, 3, side, side, dtype=torch.bfloat16), "input_ids": ids,
                  "attention_mask": torch.ones(b, prompt, dtype=torch.long), "state": torch.randn(b, 1, s),
                  "action": torch.randn(b, h, a), "action_mask": torch.ones(b, h, a),
                  "embodiment_id": torch.zeros(b, dtype=torch.long)}
        params = {id(p) for p in model.parameters()}
        current = ["other"]
        seen: dict = {}

        def enter(name):
            def hook(*_):
                current.append(name)
            return hook

        def leave(*_):  # a forward hook that returns something replaces the output: this one returns None
            current.pop()

        handles = []
        for name in TOWERS:
            mod = model.get_submodule(name)
            handles.append(mod.register_forward_pre_hook(enter(name)))
            handles.append(mod.register_forward_hook(leave))

        keep = []  # the saved tensors stay referenced, so an id() is never reused for another

        def pack(t):
            base = t._base if t._base is not None else t
            # a parameter or a view of one (the transposed weight a linear saves) holds no new memory
            if id(base) not in params and id(t) not in seen:
                keep.append(t)
                seen[id(t)] = (current[-1], t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(inputs, torch.randn(b, h, a), torch.rand(b))
        for hd in handles:
            hd.remove()
    out = dict.fromkeys(TOWERS + ("other",), 0)
    for tower, nbytes in seen.values():
        out[tower] += nbytes
    return {"by_tower": out, "prompt_tokens": prompt, "image_tokens": images * per_image}


def project(table: dict, act: dict, *, tp: int, sp: int, dp: int, zero: int, everything: bool,
            micro_batch: int) -> dict:
    states = model_states(table, tp=tp, shard=sp * dp, zero=zero, everything=everything)
    t = act["by_tower"]
    backbone = sum(t[k] for k in BACKBONE)
    head = sum(v for k, v in t.items() if k not in BACKBONE)
    per_gpu_act = micro_batch * (backbone / (tp * sp) + head / tp)
    total = sum(states.values()) + per_gpu_act
    return {**{k: v / GB for k, v in states.items()}, "activations": per_gpu_act / GB, "total": total / GB}


def run(recipe: str, layouts, *, zero: int, micro_batch: int, images: int, ac_every: list[int]) -> dict:

    cfg = make(recipe).model.replace(tune_llm=False, tune_visual=False, tune_top_llm_layers=4)  # N1.6 fine-tune
    table = param_table(cfg)
    rows = []
    for everything in (False, True):
        for ac in ac_every:
            act = activations(cfg, images=images, ac_every=ac, everything=everything)
            for lay in layouts:
                tp, sp, dp = _layout(lay)
                rows.append({"layout": lay, "zero": zero, "trainable": "all" if everything else "n1.6 default",
                             "ac_every": ac, "micro_batch": micro_batch,
                             **project(table, act, tp=tp, sp=sp, dp=dp, zero=zero, everything=everything,
                                       micro_batch=micro_batch),
                             "act_per_sample_gb": {k: v / GB for k, v in act["by_tower"].items()}})
    n = sum(v[0] for v in table.values())
    return {"version": 1, "recipe": recipe, "params": n,
            "trainable_default": sum(v[0] for v in table.values() if v[2]), "images": images,
            "prompt_tokens": act["prompt_tokens"], "image_tokens": act["image_tokens"], "rows": rows}


def format_table(doc: dict) -> str:
    lines = [f"GR00T N1.6 ({doc['recipe']}, {doc['params']:,} parameters; N1.6's fine-tune trains "
             f"{doc['trainable_default']:,}), {doc['images']} images x {doc['image_tokens'] // doc['images']} "
             f"tokens, {doc['prompt_tokens']}-token prompt; GB per GPU",
             "| trainable | AC | layout tp x sp x dp | ZeRO | params | grads | optimizer | largest gather "
             "| activations (micro-batch) | total |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['trainable']} | {r['ac_every'] or 'off'} | {r['layout']} | {r['zero']} | "
                     f"{r['params']:.2f} | {r['grads']:.2f} | {r['optimizer']:.2f} | {r['gathered']:.2f} | "
                     f"{r['activations']:.2f} ({r['micro_batch']}) | {r['total']:.2f} |")
    lines.append("activations: saved bytes of a full-size forward (FakeTensorMode), backbone / (tp x sp), action "
                 "head / tp: an estimate; model states are exact for the parameter table and the ZeRO rules")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="gr00t-n1.6", help="the model (default: the released N1.6)")
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), help="tp x sp x dp, e.g. 2x4x4")
    p.add_argument("--zero", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--micro-batch", type=int, default=8, help="samples per GPU per micro-step")
    p.add_argument("--images", type=int, default=2, help="images per sample (cameras x frames)")
    p.add_argument("--ac-every", type=int, nargs="+", default=[0, 1], help="activation checkpointing settings")
    p.add_argument("--out", default=None, help="JSON path (default results/memory-<recipe>.json)")


def handle(args) -> int:
    doc = run(args.recipe, args.layouts, zero=args.zero, micro_batch=args.micro_batch, images=args.images,
              ac_every=args.ac_every)
    out = args.out or os.path.join(RESULTS_DIR, f"memory-{args.recipe}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(format_table(doc))
    print(f"wrote {out}")
    return 0
