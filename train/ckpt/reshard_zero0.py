"""ZeRO-0 on either side of `loongforge ckpt reshard` (reshard.py).

A ZeRO-0 run (fp32) keeps a plain torch AdamW: each TP rank's `mp_rank_XX_model_states.pt` holds
the whole module (the fp32 weights are the master weights) and `optimizer`, torch's state dict
(state keyed by the index of the parameter in model.parameters(), one param group). DP ranks
hold identical copies, so only the rank count of TP matters.

    source ZeRO-0 -> universal_from_zero0: the same per-parameter folders ds_to_universal writes
        (zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt, zero/optimizer_state.pt with the param
        groups), so the rest of the converter (TP merge/split, any target) is unchanged.
    target ZeRO-0 -> to_zero0_files: DeepSpeed's universal loader fills ZeRO-1/2/3 optimizers
        only, so the universal folder is turned back into ordinary ZeRO-0 files (module + torch
        optimizer state), which the trainer loads as they are on any DP degree.

bf16 ZeRO-0 runs DeepSpeed's BF16_Optimizer, which partitions its fp32 master weights into
zero_pp_rank_* files like ZeRO-1: that source goes through ds_to_universal as ZeRO-1/2 do.
"""

from __future__ import annotations

import os
import shutil

import torch

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt.files import load_trusted
from loongforge.train.ckpt.reshard_io import save_tensor_file

MODEL_STATES = "mp_rank_{tp:02d}_model_states.pt"


def is_plain(src: str) -> bool:
    """A ZeRO-0 tag with a plain torch optimizer (no BF16_Optimizer partitions)."""
    return not any(n.startswith("zero_pp_rank_") for n in os.listdir(src))


def universal_from_zero0(src: str, work: str, tp: int, trained: list[str]) -> list[str]:
    """One universal folder per source TP rank, from its model-states file; `trained`: the names of the
    parameters the optimizer holds, in model.parameters() order (the frozen ones: reshard_frozen.py)."""
    out = []
    for t in range(tp):
        states = load_trusted(os.path.join(src, MODEL_STATES.format(tp=t)))
        module, optim = states.get("module"), states.get("optimizer")
        if not module or not optim or "param_groups" not in optim:
            raise CheckpointError(f"{src}: {MODEL_STATES.format(tp=t)} holds no module and torch optimizer state; "
                                  "not a ZeRO-0 checkpoint of a plain (fp32) optimizer")
        names, groups = [n for n in trained if n in module], optim["param_groups"]
        index = [i for g in groups for i in g["params"]]
        if len(groups) != 1 or len(index) != len(names):
            raise CheckpointError(f"{src}: the torch optimizer has {len(groups)} param groups over {len(index)} "
                                  f"parameters, the module {len(names)} trained ones: expected one group over "
                                  "every trained parameter (parallelize.py passes them)")
        udir = os.path.join(work, f"universal_src_tp{t:02d}")
        # One step for all: a parameter that never had a gradient has no torch state (Adam's zeros, below).
        step = max((int(st["step"]) for st in optim["state"].values() if "step" in st), default=0)
        for name, i in zip(names, index, strict=True):
            st = optim["state"].get(i, {})
            weight = module[name].float()
            for key, value in (("fp32", weight), ("exp_avg", st.get("exp_avg")), ("exp_avg_sq", st.get("exp_avg_sq"))):
                value = torch.zeros_like(weight) if value is None else value
                save_tensor_file(os.path.join(udir, "zero", name, f"{key}.pt"), {"param": value.float().clone()})
            save_tensor_file(os.path.join(udir, "zero", name, "step.pt"), torch.tensor(float(step)))
        meta = {k: v for k, v in states.items() if k not in ("module", "optimizer")}
        torch.save({"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                    "ds_version": meta.get("ds_version"), "zero_stage": 0},
                   os.path.join(udir, "zero", "optimizer_state.pt"))
        torch.save(meta, os.path.join(udir, MODEL_STATES.format(tp=0)))
        out.append(udir)
    return out


def to_zero0_files(tag_dir: str, udir: str, t: int, meta: dict, optim: dict, *, step: int,
                   names: list[str], frozen: dict[str, torch.Tensor]) -> None:
    """Target TP rank t's universal folder `udir` (inside tag_dir) -> tag_dir/mp_rank_{t}_model_states.pt
    with the module (fp32; `frozen`: this TP rank's frozen parameters) and the torch AdamW state dict
    (indexed in `names` order: the trained parameters of the target model); the folder is removed."""
    zero = os.path.join(udir, "zero")
    missing = [n for n in names if not os.path.isdir(os.path.join(zero, n))]
    if missing:
        raise CheckpointError(f"universal folder {zero} lacks parameters {missing[:5]}")
    groups = optim["param_groups"]
    if len(groups) != 1:
        raise CheckpointError(f"the source optimizer has {len(groups)} param groups; ZeRO-0 output expects one")

    def part(name, key):
        p = load_trusted(os.path.join(zero, name, f"{key}.pt"))
        return p["param"] if isinstance(p, dict) else p

    module = {**{name: part(name, "fp32") for name in names}, **frozen}
    state = {i: {"step": torch.tensor(float(step)), "exp_avg": part(name, "exp_avg"),
                 "exp_avg_sq": part(name, "exp_avg_sq")} for i, name in enumerate(names)}
    group = {k: v for k, v in groups[0].items() if k != "params"}
    out = {**meta, "module": module,
           "optimizer": {"state": state, "param_groups": [{**group, "params": list(range(len(names)))}]}}
    torch.save(out, os.path.join(tag_dir, MODEL_STATES.format(tp=t)))
    shutil.rmtree(udir)
