"""Isaac-GR00T N1.6 checkpoint directories in and out.

In (`--init-from DIR`): config.json (read by model/config.py) and the weights, `model.safetensors`
or shards named by `model.safetensors.index.json`, loaded by name into the model, whose parameter
names are the reference's; the tied LM head (absent from the reference's files as from ours) is
the only name allowed to differ. A missing, unexpected or mis-shaped tensor, or a file that is not
whole, is one CheckpointError naming it, found from the files' headers by check_gr00t_weights before
the run writes anything (preflight). The dtypes the file stored are returned (kept in the run's sidecar) so an export writes each
tensor back in its own dtype: init-from -> export is tensor-identical for what did not train.

Out (`loongforge export RUN --format gr00t OUT`, `export_gr00t`): what Isaac-GR00T's loader reads:
config.json (the head's fields + `eagle_config`, which its loader ignores and ours reads),
safetensors with the same names (sharded above 5 GB, with the index), and the processor's files:
processor_config.json, statistics.json (the training episodes' min/max/mean/std per state and
action group, N1.6's normalisation) and embodiment_id.json; the tokenizer's files when the run had
one. Every file is written to a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loongforge.shared.errors import CheckpointError
from loongforge.train.model.build import build_model
from loongforge.train.model.config import GrootConfig, to_gr00t_json

TIED = ("backbone.model.language_model.lm_head.weight",)  # tied to embed_tokens: never stored
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 << 30  # transformers' default max_shard_size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "chat_template.json", "preprocessor_config.json", "processor_config.json")


def weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, the index's order when sharded."""
    idx = os.path.join(path, INDEX)
    if os.path.exists(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{idx}: unreadable shard index ({exc})") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{path}: shard(s) {', '.join(missing)} named by {INDEX} are missing")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or {INDEX} (an Isaac-GR00T N1.6 checkpoint directory "
                          "holds config.json and its safetensors)")


def _expected(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint must hold for `model`: its parameters (a tied one once) and persistent buffers."""
    buffers = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    return {**dict(model.named_parameters()), **buffers}


def _mismatch(path: str, found: dict[str, tuple], want: dict[str, tuple]) -> None:
    """One CheckpointError naming what does not match (names and shapes), or nothing."""
    bad_shape = [f"{n} {found[n]} vs the model's {want[n]}" for n in found if n in want and found[n] != want[n]]
    missing = sorted(set(want) - set(found))
    unexpected = sorted(set(found) - set(want))
    if bad_shape or missing or unexpected:
        parts = [f"{len(bad_shape)} of another shape ({bad_shape[0]})" if bad_shape else "",
                 f"{len(missing)} missing ({missing[0]}{', ...' if len(missing) > 1 else ''})" if missing else "",
                 f"{len(unexpected)} unexpected ({unexpected[0]}{', ...' if len(unexpected) > 1 else ''})"
                 if unexpected else ""]
        raise CheckpointError(f"{path}: the weights do not match the N1.6 model its config.json describes: "
                              + "; ".join(p for p in parts if p))


@contextlib.contextmanager
def _opened(file: str):
    """safe_open, with a file it cannot read (truncated: "incomplete metadata", not safetensors) one
    CheckpointError instead of a SafetensorError traceback."""
    try:
        f = safe_open(file, framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable as safetensors ({' '.join(str(exc).split())}): truncated or not "
                              "a safetensors file; copy the checkpoint again") from None
    with f:
        yield f


def check_gr00t_weights(cfg: GrootConfig, path: str) -> None:
    """Before a run writes anything: the checkpoint's tensor names and shapes, from its files' headers
    (no tensor is read), against the model `cfg` describes, built on the meta device. One
    CheckpointError for a file that cannot be read or a tensor that does not match."""
    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in _expected(build_model(cfg)).items()}
    found = {}
    for file in weight_files(path):
        with _opened(file) as f:
            found.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n not in TIED})
    _mismatch(path, found, want)


def load_gr00t_weights(model: torch.nn.Module, path: str) -> dict[str, str]:
    """Load a checkpoint directory's tensors into `model` by name (cast to each parameter's dtype).
    Returns the stored dtypes (for the sidecar). One CheckpointError for what does not match."""
    want = _expected(model)
    found, dtypes = {}, {}
    for file in weight_files(path):
        with _opened(file) as f:
            for name in f.keys():
                if name in TIED:
                    continue
                found[name] = tuple(f.get_slice(name).get_shape())
                if name not in want or found[name] != tuple(want[name].shape):
                    continue
                t = f.get_tensor(name)
                dtypes[name] = str(t.dtype).removeprefix("torch.")
                with torch.no_grad():
                    want[name].copy_(t.to(want[name].dtype))
    _mismatch(path, found, {n: tuple(t.shape) for n, t in want.items()})
    return dtypes


def export_dtype(name: str, trainable: set[str], stored: dict[str, str] | None) -> torch.dtype:
    """What a tensor is written as: the dtype it came in with (init-from), else as the reference
    constructs it: trainable fp32, frozen bf16."""
    if stored and name in stored:
        return getattr(torch, stored[name])
    return torch.float32 if name in trainable else torch.bfloat16


def export_gr00t(state: dict[str, torch.Tensor], cfg: GrootConfig, out: str, *, trainable: set[str],
                 stored: dict[str, str] | None, processor: dict, statistics: dict, embodiment: dict,
                 tokenizer: str | None) -> list[str]:
    """Write a GR00T N1.6 checkpoint directory at `out` (must not exist). Returns the files written."""
    if os.path.exists(out):
        raise CheckpointError(f"{out} exists; export writes a new directory (remove it or pick another path)")
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        tensors = {n: t.detach().to("cpu", export_dtype(n, trainable, stored)).contiguous() for n, t in state.items()}
        _save_weights(tensors, tmp)
        docs = {"config.json": to_gr00t_json(cfg), "processor_config.json": processor,
                "statistics.json": statistics, "embodiment_id.json": embodiment}
        for name, doc in docs.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
        if tokenizer:
            for name in TOKENIZER_FILES:
                src = os.path.join(tokenizer, name)
                if os.path.exists(src) and name not in docs:
                    shutil.copy2(src, os.path.join(tmp, name))
        files = sorted(os.listdir(tmp))
        _follow_umask(tmp, files)
        os.rename(tmp, out)
        return files
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _follow_umask(d: str, files: list[str]) -> None:
    """The modes a plain write would give (0755 / 0644 under umask 022, as torch.save and
    save_pretrained leave them): mkdtemp made the directory 0700 and safetensors writes 0600, so a
    colleague or the serving user could not read the export; copied tokenizer files kept their source's."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for name in files:
        os.chmod(os.path.join(d, name), 0o666 & ~umask)


def _save_weights(tensors: dict[str, torch.Tensor], d: str) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= SHARD_BYTES:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if cur and size + nb > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + nb
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(d, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
