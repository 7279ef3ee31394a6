"""Incremental checkpoints: a save between two full ones stores, per DeepSpeed
file, only the XOR of each tensor's bit pattern against the same tensor of the
last full save, zstd-compressed.

Why XOR of bits (split into byte planes before zstd): exact (restore is bitwise, NaN payloads and -0.0 included),
dtype-agnostic (fp32, bf16, int), and small in practice: between nearby steps
the sign and exponent bits and the high mantissa bits rarely change, so the XOR
is mostly zero bytes, which zstd packs tightly. A delta larger than
`max_ratio` x the full size is not worth a chain: the save falls back to full.

On disk, next to the usual sidecar and manifest, `NAME.delta` replaces each
DeepSpeed file NAME: torch.save of {"format", "format_version", "base",
"tree"} where each tensor of the original state dict is a dict
{"__delta__": uint8 tensor (zstd of the XOR), "dtype", "shape"} (or the tensor
itself when the base has no same-shaped tensor at that place). Everything is
plain data: it loads with weights_only=True. Restore = base file + delta
(`restore_deltas`, on resume: rank 0 writes the full files DeepSpeed expects).
"""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import torch
import zstandard

from loongforge.shared.errors import CheckpointError
from loongforge.train.ckpt.fallback import raise_unless_rank0_ok
from loongforge.train.ckpt.files import ckpt_root, load_trusted, verify_manifest

DELTA_VERSION = 1
SUFFIX = ".delta"
_LEVEL = 3  # zstd level: ~the speed of the disk write, most of the gain of higher levels
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()]).numpy().reshape(-1)


def encode(state, base) -> tuple[object, int]:
    """The delta tree of `state` against `base` (same nesting) and its payload bytes."""
    cctx = zstandard.ZstdCompressor(level=_LEVEL)
    total = [0]

    def walk(s, b):
        if torch.is_tensor(s):
            if torch.is_tensor(b) and b.shape == s.shape and b.dtype == s.dtype and s.dtype in _DTYPES_OK:
                x = np.bitwise_xor(_bits(s), _bits(b))
                # Byte planes (all high bytes, then the next...): the unchanged high bytes form long zero runs.
                blob = cctx.compress(x.view(np.uint8).reshape(-1, x.itemsize).T.tobytes())
                total[0] += len(blob)
                return {"__delta__": torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                        "dtype": str(s.dtype).removeprefix("torch."), "shape": list(s.shape)}
            total[0] += s.numel() * s.element_size()
            return s
        if isinstance(s, dict):
            bd = b if isinstance(b, dict) else {}
            return type(s)((k, walk(v, bd.get(k))) for k, v in s.items())
        if isinstance(s, (list, tuple)):
            bl = b if isinstance(b, (list, tuple)) and len(b) == len(s) else [None] * len(s)
            return type(s)(walk(v, bv) for v, bv in zip(s, bl))
        return s

    return walk(state, base), total[0]


_DTYPES_OK = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
              torch.int16, torch.uint8, torch.int8, torch.bool}


def decode(tree, base):
    """Inverse of encode: the original state, bit for bit."""
    dctx = zstandard.ZstdDecompressor()

    def walk(s, b):
        if isinstance(s, dict) and "__delta__" in s and "shape" in s:
            dtype = getattr(torch, s["dtype"])
            bb = _bits(b)
            planes = np.frombuffer(dctx.decompress(s["__delta__"].numpy().tobytes()), dtype=np.uint8)
            x = planes.reshape(bb.itemsize, -1).T.copy().view(bb.dtype).reshape(-1)
            raw = torch.from_numpy(np.bitwise_xor(x, bb))
            if dtype == torch.bool:
                return raw.view(torch.uint8).to(torch.bool).reshape(s["shape"])
            return raw.view(dtype).reshape(s["shape"])
        if isinstance(s, dict):
            bd = b if isinstance(b, dict) else {}
            return type(s)((k, walk(v, bd.get(k))) for k, v in s.items())
        if isinstance(s, (list, tuple)):
            bl = b if isinstance(b, (list, tuple)) and len(b) == len(s) else [None] * len(s)
            return type(s)(walk(v, bv) for v, bv in zip(s, bl))
        return s

    return walk(tree, base)


def wrap(tree, base_tag: str) -> dict:
    return {"format": "loongforge-delta", "format_version": DELTA_VERSION, "base": base_tag, "tree": tree}


def clone_tree(item):
    """A private copy of a snapshot (the snapshot engine reuses its host buffers)."""
    if torch.is_tensor(item):
        return item.detach().clone()
    if isinstance(item, dict):
        return type(item)((k, clone_tree(v)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tree(v) for v in item)
    return item


def nbytes(item) -> int:
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, dict):
        return sum(nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(nbytes(v) for v in item)
    return 0


def materialize_one(doc: dict, base_dir: str, out_dir: str, name: str, load) -> str:
    """Write the full file of one NAME.delta (already loaded as `doc`) into out_dir, from the base file in
    base_dir. `load(path)` is the caller's trusted (weights-only) loader. Returns the file name written."""
    if doc.get("format") != "loongforge-delta" or doc.get("format_version") != DELTA_VERSION:
        raise CheckpointError(f"{name}: not a delta of format_version {DELTA_VERSION}; resume with the "
                              "LoongForge version that wrote it")
    full = name[: -len(SUFFIX)]
    state = decode(doc["tree"], load(os.path.join(base_dir, full)))
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(os.path.join(out_dir, full), "wb") as f:
        f.write(buf.getvalue())
    return full


def restore_deltas(run_dir: str, tag: str, bases: list[str], *, rank: int, device) -> str:
    """For a delta save: rank 0 decodes base + delta into TAG_restored/ (the files DeepSpeed expects);
    every rank returns that tag. Collective, so a failed decode raises on every rank instead of a hang."""
    root = ckpt_root(run_dir)
    out_tag = f"{tag}_restored"
    err = ""
    if rank == 0:
        try:
            for base in bases:
                verify_manifest(run_dir, base)
            materialize(root, tag, bases, out_tag)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            err = f"{type(exc).__name__}: {exc}"
    raise_unless_rank0_ok(err, device=device,
                          failed=f"restoring delta checkpoint {tag} from its base {bases} failed",
                          hint="point `latest` at the base (a full save)")
    return out_tag


def materialize(root: str, tag: str, bases: list[str], out_tag: str) -> None:
    """root/out_tag/ = the full DeepSpeed files of delta save root/tag (its bases already verified)."""
    src, out = os.path.join(root, tag), os.path.join(root, out_tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in os.listdir(src):  # files saved full (no base, or a fallback) are used as they are
        if name.endswith(".pt"):
            os.link(os.path.join(src, name), os.path.join(out, name))
    for name in sorted(n for n in os.listdir(src) if n.endswith(SUFFIX)):
        doc = load_trusted(os.path.join(src, name))
        materialize_one(doc, os.path.join(root, doc.get("base", "")), out, name, load_trusted)
