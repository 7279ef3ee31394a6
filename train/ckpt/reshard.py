"""`loongforge ckpt reshard RUN --to world=W,zero=Z,tp=T`: convert a checkpoint to another layout
(rank count / DP degree, ZeRO stage 0-3, tensor-parallel degree), both ways, offline.

    source tag (any of ZeRO-0/1/2/3 x TP, any rank count)
      -> per TP rank t: DeepSpeed's ds_to_universal on a view of that TP rank's files
         (fp32 ZeRO-0: the same folders from its torch optimizer state, reshard_zero0.py)
         (one folder per parameter: fp32 master weight, exp_avg, exp_avg_sq)      [layout-free in DP/ZeRO]
      -> our TP merge: the full tensor of every parameter, by the index rules of
         parallel/tensor_parallel.py (column rows by head, row columns)     [layout-free]
      -> our TP split for the target degree, written per target TP rank as a
         universal folder `universal_tpXX/` holding exactly that rank's shards     [target layout]
         (ZeRO-0 target: turned back into ordinary ZeRO-0 files, reshard_zero0.py)
      -> top-k residuals (--grad-compression topk) by the rule in reshard_topk.py
      -> new tag `stepNNNNNNNN_wWzZtT` (sidecar + manifest), `latest` moved to it LAST
         (the elastic supervisor moves it itself, after verifying the tag: resilience/elastic/reshard.py).

The trainer (checkpoint.load) sees `resharded` in the sidecar and loads each rank's
`universal_tpXX/` through DeepSpeed's load_universal path, which cuts the per-rank shards
into the target ZeRO partition itself (DP degree and stage). Kept: fp32 master weights, both
Adam moments, the optimizer step, LR scheduler and DeepSpeed's global step, the sidecar with
the loader position (global sample position: the data order continues exactly), model and
data config. RNG files are per source rank and are not carried: the noise of a sample is a
function of its global id, not of the rank that trains it (model/noise.py).
Positional embeddings, camera/frame embeddings, the learned bin query and the text embedding
(mask / special tokens included) are ordinary replicated parameters in this model: they travel
with their Adam state like any other (the converter checks the TP copies agree).

Why our own TP step: DeepSpeed's converter merges TP slices only from AutoTP/Megatron
metadata (`universal_checkpoint_info`), which a custom TP layout lacks, and its ZeRO-3
universal loader does not slice non-AutoTP TP shards. So each TP rank's files are converted
as a TP-1 checkpoint and the TP merge/split is done here, where the layout is defined.

Trust: DeepSpeed's converter calls torch.load(weights_only=False); it runs in a child process
under TORCH_FORCE_WEIGHTS_ONLY_LOAD (universal.py), after the source manifest was verified.
Every load here is weights_only=True with DeepSpeed's few value types allowlisted.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

import torch

from loongforge.shared.errors import CheckpointError, UsageError
from loongforge.train.ckpt import reshard_frozen, reshard_topk, reshard_zero0, universal as ckpt_universal
from loongforge.train.ckpt.delta import materialize
from loongforge.train.ckpt.files import ckpt_root, latest_tag, load_trusted, read_sidecar, tag_for, verify_manifest
from loongforge.train.ckpt.reshard_io import (META_NAMES, RESHARD_VERSION, load_tag_dir, publish, read_step,
                                              save_tensor_file, source_meta, target_meta, target_optimizer_state)
from loongforge.train.model.build import build_model
from loongforge.train.model.config import model_config_from
from loongforge.train.parallel.tensor_parallel import TP_PLAN, chunk_index, tp_modules

log = logging.getLogger(__name__)
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    world: int  # ranks (= tp * sp * dp)
    zero: int  # ZeRO stage (0: plain torch optimizer, reshard_zero0.py; 1, 2, 3)
    tp: int = 1  # tensor-parallel degree
    sp: int = 1  # sequence-parallel degree: Ulysses keeps weights replicated over SP, so it only changes the DP
    # partition, which DeepSpeed's universal loader cuts (TP stays innermost in the rank placement, plan.py)

    def __post_init__(self):
        if self.world < 1:
            raise UsageError(f"--to world={self.world}: must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise UsageError(f"--to zero={self.zero}: ZeRO stages are 0, 1, 2 and 3")
        if self.zero == 0 and self.tp > 1:
            raise UsageError(f"--to zero=0,tp={self.tp}: ZeRO-0 output is written for tp=1 only (torch's "
                              "optimizer indexes the TP-swapped model's parameters); use zero=1")
        if self.tp < 1 or self.sp < 1 or self.world % (self.tp * self.sp):
            raise UsageError(f"--to world={self.world},tp={self.tp}: world must be a multiple of tp*sp")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.sp)

    def slug(self) -> str:
        return f"w{self.world}z{self.zero}t{self.tp}" + (f"s{self.sp}" if self.sp > 1 else "")

    @classmethod
    def parse(cls, text: str, *, default_world: int) -> "Layout":
        """"world=4,zero=2,tp=1" (also dp=D instead of world: world = dp*tp*sp)."""
        vals: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key not in ("world", "dp", "zero", "tp", "sp") or not val.isdigit():
                raise UsageError(f"--to {text!r}: expected comma-separated world=N, dp=N, zero=N, tp=N, sp=N "
                                  "(e.g. world=4,zero=2,tp=1)")
            vals[key] = int(val)
        if "zero" not in vals:
            raise UsageError(f"--to {text!r}: name the ZeRO stage, e.g. zero=2")
        tp, sp = vals.get("tp", 1), vals.get("sp", 1)
        world = vals.get("world", vals["dp"] * tp * sp if "dp" in vals else default_world)
        if "dp" in vals and world != vals["dp"] * tp * sp:
            raise UsageError(f"--to {text!r}: world != dp*tp*sp")
        return cls(world=world, zero=vals["zero"], tp=tp, sp=sp)


def check_batch(doc: dict, to: Layout) -> None:
    """The target's DP degree must divide the checkpoint's global batch (the resume keeps it): refused
    before anything is written."""
    batch = doc.get("global_batch_size")
    if batch and batch % to.dp:
        fits = [d for d in range(1, batch + 1) if batch % d == 0]
        raise UsageError(f"--to {to.slug()}: {to.dp} data-parallel ranks cannot split this checkpoint's global "
                          f"batch of {batch}; use a DP degree (world / (tp*sp)) in {fits}")


def resume_accum(doc: dict, to: Layout) -> int:
    """The --grad-accum a resume on `to` needs: the smallest that splits the global batch over the target's
    DP ranks into micro-batches no larger than the source's (so it fits where the source fitted)."""
    batch = doc.get("global_batch_size")
    if not batch:
        return 1
    src = source_layout(doc)
    micro = max(1, batch // (src.dp * doc.get("grad_accum", 1)))
    return next(a for a in range(1, batch + 1) if batch % (to.dp * a) == 0 and batch // (to.dp * a) <= micro)


def resume_hint(doc: dict, to: Layout) -> str:
    """The flags that resume a checkpoint resharded to `to` with the same global batch and step arithmetic."""
    flags = f"--zero {to.zero} --tp {to.tp}" + (f" --sp {to.sp}" if to.sp > 1 else "")
    if doc.get("global_batch_size"):
        flags += f" --batch-size {doc['global_batch_size']} --grad-accum {resume_accum(doc, to)}"
    return flags + " --resume"


def source_layout(doc: dict) -> Layout:
    par = {"tp": 1, "sp": 1, **doc.get("parallel", {})}
    stage = doc.get("zero_stage")
    if stage not in (0, 1, 2, 3):
        raise CheckpointError(f"checkpoint sidecar records ZeRO stage {stage!r}: reshard reads ZeRO-0/1/2/3 "
                              "checkpoints")
    return Layout(world=doc["world"], zero=stage, tp=par["tp"], sp=par["sp"])


# ---- TP rules: where each parameter's shards sit in the full tensor (parallel/tensor_parallel.py) ----

def full_shapes(doc: dict) -> dict[str, torch.Size]:
    """Every parameter's full (TP-1) shape, from the model the sidecar describes, on the meta device."""
    return {n: p.shape for n, p in _meta_model(doc).named_parameters()}


def trained_names(doc: dict) -> list[str]:
    """The parameters the optimizer holds (requires_grad under the sidecar's tune switches), in
    model.parameters() order; the rest are frozen (reshard_frozen.py)."""
    return [n for n, p in _meta_model(doc).named_parameters() if p.requires_grad]


def _meta_model(doc: dict):
    with torch.device("meta"):
        return build_model(model_config_from(doc))


def tp_kinds(doc: dict) -> dict[str, str]:
    """Parameter name -> "col" | "row" for the TP-split parameters (the rest, row biases included, are
    replicated), from the model the sidecar describes, built on the meta device (no memory)."""
    kinds = {}
    for prefix, mod in tp_modules(_meta_model(doc)):
        for path, kind in TP_PLAN[type(mod).__name__]:
            if kind == "sum":
                continue  # replicated (its gradient is summed over TP, its value identical)
            p = f"{prefix}.{path}." if prefix else f"{path}."
            kinds[p + "weight"] = kind
            if kind == "col" and getattr(_get(mod, path), "bias", None) is not None:
                kinds[p + "bias"] = "col"
    return kinds


def _get(mod, path: str):
    for part in path.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    return mod


def _index(kind: str, full_shape: torch.Size, t: int, tp: int) -> tuple[int, torch.Tensor]:
    dim = 0 if kind == "col" else 1
    return dim, chunk_index(full_shape[dim], t, tp)


def local_shape(full: torch.Size, kind: str | None, tp: int) -> torch.Size:
    if kind is None or tp == 1:
        return full
    shape = list(full)
    shape[1 if kind == "row" else 0] //= tp
    return torch.Size(shape)


def merge_tp(parts: list[torch.Tensor], kind: str | None, name: str) -> torch.Tensor:
    """Full tensor from the TP shards (rank order). Replicated: the TP copies must agree."""
    if kind is None or len(parts) == 1:
        for t, p in enumerate(parts[1:], 1):
            if not torch.equal(p, parts[0]):
                log.warning("reshard: replicated parameter %s differs between TP ranks 0 and %d (max |diff| %.3g); "
                            "keeping TP rank 0's copy", name, t, (p - parts[0]).abs().max().item())
        return parts[0]
    dim = 0 if kind == "col" else 1
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    full = torch.empty(shape, dtype=parts[0].dtype)
    for t, part in enumerate(parts):
        d, idx = _index(kind, full.shape, t, len(parts))
        full.index_copy_(d, idx, part)
    return full


def split_tp(full: torch.Tensor, kind: str | None, t: int, tp: int) -> torch.Tensor:
    if kind is None or tp == 1:
        return full
    d, idx = _index(kind, full.shape, t, tp)
    if full.shape[d] % tp:
        raise CheckpointError(f"tp={tp} does not divide dimension {d} ({full.shape[d]}) of a TP-split parameter")
    return full.index_select(d, idx).contiguous()


# ---- the conversion ----

def _tp_view(src: str, view: str, t: int, tp: int) -> None:
    """A directory in which TP rank t's files of `src` look like a TP-1 checkpoint: optimizer files hard-linked,
    model-states files rewritten with tp_degree 1 (DeepSpeed's converter checks the file count against it) and
    an empty `universal_checkpoint_info` (it asserts its presence for ZeRO-1/2; empty = no Megatron patterns,
    every parameter whole, which is what one TP rank's files are)."""
    os.makedirs(view)
    pat = re.compile(rf"(.*mp_rank_){t:02d}(_(model|optim)_states\.pt)$")
    for name in os.listdir(src):
        m = pat.match(name)
        if not m:
            continue
        path, dst = os.path.join(src, name), os.path.join(view, f"{m.group(1)}00{m.group(2)}")
        if m.group(3) == "optim":
            os.link(path, dst)
            continue
        states = load_trusted(path)
        states["mp_world_size"] = 1
        states.setdefault("universal_checkpoint_info", {})
        states["checkpoint_parallel_dimensions"] = {**states.get("checkpoint_parallel_dimensions", {}),
                                                    "tp_degree": 1}
        torch.save(states, dst)


def _universal_per_tp(src: str, work: str, tp: int, timeout_s: float = 3600.0) -> list[str]:
    """ds_to_universal of each source TP rank, all in one child process (weights-only guard, as
    universal.py): DeepSpeed's import dominates a small conversion."""
    pairs = []
    for t in range(tp):
        view, dst = os.path.join(work, f"src_tp{t:02d}"), os.path.join(work, f"universal_src_tp{t:02d}")
        _tp_view(src, view, t, tp)
        pairs += [view, dst]
    log.info("converting %d TP rank(s) of %s with DeepSpeed's ds_to_universal", tp, src)
    err = ckpt_universal.run_converter(pairs, timeout_s)
    if err:
        raise CheckpointError(f"converting {src} to DeepSpeed's universal format failed: {err[:500]}; try one TP "
                              f"rank by hand: {ckpt_universal.convert_command(pairs[0])}")
    return pairs[1::2]


def _param_names(udir: str) -> list[str]:
    zero = os.path.join(udir, "zero")
    return sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))


def _write_target(src_udirs: list[str], out_dirs: list[str], doc: dict, *, step: int, target: Layout) -> int:
    """Stream parameter by parameter: merge the source TP shards, split for the target, write. Returns the
    number of parameters. ZeRO-3's universal files are flat: every part is viewed in its TP-local shape."""
    kinds, shapes, trained = tp_kinds(doc), full_shapes(doc), set(trained_names(doc))
    found = _param_names(src_udirs[0])
    # ds_to_universal writes a ZeRO-1/2 source's frozen parameters too (weights only): they travel in frozen.pt
    if not trained <= set(found) <= set(shapes):
        raise CheckpointError(f"the checkpoint's trained parameters differ from the model its sidecar describes "
                              f"({sorted((set(found) - set(shapes)) | (trained - set(found)))[:5]}...): not a "
                              "checkpoint of this model")
    for other in src_udirs[1:]:
        if _param_names(other) != found:
            raise CheckpointError(f"TP ranks of the source hold different parameter sets ({other})")
    names = [n for n in found if n in trained]
    step_t = torch.tensor(float(step))
    for name in names:
        for state in STATES:
            parts = [load_trusted(os.path.join(u, "zero", name, f"{state}.pt")) for u in src_udirs]
            src_shape = local_shape(shapes[name], kinds.get(name), len(src_udirs))
            parts = [(p["param"] if isinstance(p, dict) else p).reshape(src_shape) for p in parts]
            full = merge_tp(parts, kinds.get(name), name)
            for t, out in enumerate(out_dirs):
                save_tensor_file(os.path.join(out, "zero", name, f"{state}.pt"),
                                 {"param": split_tp(full, kinds.get(name), t, target.tp)})
        for out in out_dirs:  # ZeRO-1/2 read the Adam step per parameter (ZeRO-3 from optimizer_state.pt)
            save_tensor_file(os.path.join(out, "zero", name, "step.pt"), step_t)
    return len(names)


def reshard(run_dir: str, to: Layout, *, tag: str | None = None, move_latest: bool = True) -> str:
    """Convert checkpoint `tag` (default: latest) of `run_dir` to layout `to`; returns the new tag, which
    `latest` names afterwards unless move_latest=False (the source tag is kept)."""
    root = ckpt_root(run_dir)
    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"no checkpoint under {root}; train with --save-every first")
    doc = read_sidecar(run_dir, tag)
    src_layout = source_layout(doc)
    check_batch(doc, to)
    new_tag = f"{tag_for(int(doc['step']))}_{to.slug()}"
    work = os.path.join(root, f".reshard-{new_tag}")  # no "step" prefix: never taken for save debris
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        src = _full_source(run_dir, tag, doc, work)
        kinds, shapes, trained = tp_kinds(doc), full_shapes(doc), trained_names(doc)
        frozen_names = [n for n in shapes if n not in set(trained)]
        if doc.get("resharded", {}).get("dir"):  # resharded again before any save: universal per TP rank already
            udirs = [os.path.join(root, load_tag_dir(doc, tag, t)) for t in range(src_layout.tp)]
            frozen = _previous_frozen(os.path.join(root, tag), frozen_names)
            src = udirs[0]
        else:
            frozen = reshard_frozen.collect(src, frozen_names, src_layout.tp,
                                            lambda parts, n: merge_tp(parts, kinds.get(n), n))
            if src_layout.zero == 0 and reshard_zero0.is_plain(src):
                udirs = reshard_zero0.universal_from_zero0(src, work, src_layout.tp, trained)
            else:
                udirs = _universal_per_tp(src, work, src_layout.tp)
        out_tag_dir = os.path.join(work, "out")
        out_dirs = [os.path.join(out_tag_dir, f"universal_tp{t:02d}") for t in range(to.tp)]
        if frozen:
            torch.save(frozen, os.path.join(out_tag_dir if os.path.isdir(out_tag_dir) else _mkdir(out_tag_dir),
                                            reshard_frozen.FROZEN_FILE))
        meta = source_meta(src)
        step = read_step(udirs[0], meta)
        n = _write_target(udirs, out_dirs, doc, step=step, target=to)
        src_optim = load_trusted(os.path.join(udirs[0], "zero", "optimizer_state.pt"))
        if to.zero == 0:  # ordinary ZeRO-0 files: DeepSpeed's universal loader does not fill a torch optimizer
            for t, out in enumerate(out_dirs):
                mine = {n: split_tp(v, kinds.get(n), t, to.tp) for n, v in frozen.items()}
                reshard_zero0.to_zero0_files(out_tag_dir, out, t, target_meta(meta, to), src_optim, step=step,
                                             names=trained, frozen=mine)
        else:
            optim = target_optimizer_state(src_optim, meta, step=step, target=to)
            for t, out in enumerate(out_dirs):
                torch.save(optim, os.path.join(out, "zero", "optimizer_state.pt"))
                for meta_name in META_NAMES:
                    torch.save(target_meta(meta, to), os.path.join(out, meta_name.format(tp=t)))
        topk = None
        if reshard_topk.has_residuals(os.path.join(root, tag)):  # --grad-compression topk: the rule there
            topk = reshard_topk.carry(os.path.join(root, tag), out_tag_dir, src_layout, to)
        new_doc = {**doc, "world": to.world, "zero_stage": to.zero, "parallel": {"tp": to.tp, "sp": to.sp},
                   "resharded": {"version": RESHARD_VERSION, "from_tag": tag, "step": step, "parameters": n,
                                 "frozen_parameters": len(frozen),
                                 "from": {"world": src_layout.world, "zero_stage": src_layout.zero,
                                          "tp": src_layout.tp, "sp": src_layout.sp},
                                 "dir": None if to.zero == 0 else "universal_tp{tp:02d}",
                                 **({"topk_residuals": topk} if topk else {})}}
        publish(root, out_tag_dir, new_tag, new_doc, move_latest=move_latest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("resharded %s (%d ranks, ZeRO-%d, tp=%d) -> %s (%d ranks, ZeRO-%d, tp=%d): %d parameters with fp32 "
             "master weights and Adam moments, step %d%s", tag, src_layout.world, src_layout.zero, src_layout.tp,
             new_tag, to.world, to.zero, to.tp, n, step, "; `latest` now names it" if move_latest else "")
    return new_tag


def _mkdir(path: str) -> str:
    os.makedirs(path)
    return path


def _previous_frozen(tag_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """A resharded source's frozen parameters (its frozen.pt)."""
    path = os.path.join(tag_dir, reshard_frozen.FROZEN_FILE)
    frozen = load_trusted(path) if os.path.exists(path) else {}
    if set(frozen) != set(names):
        raise CheckpointError(f"{tag_dir}: {reshard_frozen.FROZEN_FILE} holds {len(frozen)} frozen parameters, the "
                              f"model has {len(names)}; reshard from the checkpoint it was made from")
    return frozen


def _full_source(run_dir: str, tag: str, doc: dict, work: str) -> str:
    """The source tag's directory with every DeepSpeed file whole (a delta save is decoded first), after
    the manifest check."""
    root = ckpt_root(run_dir)
    bases = verify_manifest(run_dir, tag).get("bases", []) if doc["format_version"] >= 2 else []
    if not bases:
        return os.path.join(root, tag)
    for base in bases:
        verify_manifest(run_dir, base)
    out = os.path.relpath(os.path.join(work, "restored"), root)
    materialize(root, tag, bases, out)
    return os.path.join(root, out)
