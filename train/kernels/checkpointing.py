"""Activation checkpointing every N blocks, applied to a built model from outside.

The model file never mentions checkpointing (torchtitan's `parallelize` split).
`apply_ac(model, every=N)` finds each outermost nn.ModuleList whose children are
transformer blocks and checkpoints blocks 0, N, 2N, ... with torch's
non-reentrant checkpoint. NOTE: not deepspeed.checkpointing.checkpoint: that one
is reentrant, and a block whose inputs do not require grad would get no
parameter gradients.

The block keeps its class, its parameter names and its state_dict keys (no
wrapper module is inserted): only its instance `forward` is replaced. So
checkpoints written with and without AC are interchangeable, ZeRO-3 still sees
the same modules (its hooks run on the block's `__call__`, outside the
checkpointed region; its pre-backward hook has gathered the block's parameters
before autograd reaches the recompute), and AC can be switched on or off after
the DeepSpeed engine exists.

`SavedBytesProbe` counts, exactly, the bytes autograd keeps for backward
(saved_tensors_hooks, deduplicated by storage, parameters excluded) plus the
block inputs a checkpoint keeps alive, and times the recomputation. `tune.py`
uses it; the training step never does.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_INNER = "_loongforge_ac_inner"


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(path, list) of every outermost ModuleList whose children are blocks: all of one class,
    each a composite module holding at least one nn.Linear. Lists nested inside a block (experts,
    sub-layers) are not blocks of the model, so the search does not descend into a found list."""
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList) and _is_block_list(child):
                found.append((path, child))
            else:
                visit(path, child)

    visit("", model)
    return found


def _is_block_list(ml: nn.ModuleList) -> bool:
    kids = list(ml)
    if not kids or len({type(k) for k in kids}) != 1:
        return False
    return all(any(True for _ in k.children()) and any(isinstance(m, nn.Linear) for m in k.modules())
               for k in kids)


def apply_ac(model: nn.Module, every: int, probe: SavedBytesProbe | None = None) -> list[str]:
    """Checkpoint blocks i % every == 0 of every block list; every=0 removes AC. Idempotent:
    a second call replaces the first. Returns the checkpointed blocks' paths."""
    if every < 0:
        raise ValueError(f"ac every={every}: must be >= 0 (0 = off)")
    remove_ac(model)
    if every == 0:
        return []
    done = []
    for path, blocks in block_lists(model):
        for i, blk in enumerate(blocks):
            if i % every == 0:
                _checkpoint_forward(blk, probe)
                done.append(f"{path}.{i}")
    return done


def remove_ac(model: nn.Module) -> None:
    for mod in model.modules():
        if _INNER in mod.__dict__:
            inner, was_override = mod.__dict__.pop(_INNER)
            if was_override:  # e.g. fusion.py's compiled forward: put it back
                mod.__dict__["forward"] = inner
            else:
                del mod.__dict__["forward"]


def checkpointed(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _INNER in m.__dict__]


def _checkpoint_forward(mod: nn.Module, probe: SavedBytesProbe | None) -> None:
    inner = mod.forward  # class forward (or fusion's compiled one); the block's hooks stay on its __call__
    was_override = "forward" in mod.__dict__
    trains = any(p.requires_grad for p in mod.parameters())

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)  # eval/no_grad: nothing is saved, nothing to recompute
        if not trains and not any(t.requires_grad for t in _tensors((args, kwargs))):
            # A frozen block on frozen inputs (N1.6's fine-tune: the vision tower, the LLM's lower
            # layers): autograd saves nothing there, but a checkpoint would keep its inputs alive.
            return inner(*args, **kwargs)
        if probe is not None:
            return probe.run(inner, args, kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    mod.__dict__[_INNER] = (inner, was_override)
    mod.__dict__["forward"] = forward


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class SavedBytesProbe:
    """Bytes kept for backward during one forward, and seconds spent recomputing in backward.

    Use: `with probe.forward(): loss = f(...)`, then `with probe.backward(): loss.backward()`.
    Non-reentrant checkpoint installs its own saved_tensors_hooks inside a checkpointed block
    (the innermost hooks win), so this probe sees exactly what is stored outside checkpointed
    regions; the inputs a checkpoint keeps for its recompute are added by `run`."""

    def __init__(self, model: nn.Module):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
        self._cuda = next((p.is_cuda for p in model.parameters()), False)
        self.reset()

    def reset(self) -> None:
        self._seen: dict[int, int] = {}
        self.recompute_s = 0.0
        self.recompute_calls = 0
        self._phase = "idle"

    @property
    def saved_bytes(self) -> int:
        return sum(self._seen.values())

    def _add(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # e.g. float8 tensors: count their inner data
            names, _ = t.__tensor_flatten__()
            for n in names:
                self._add(getattr(t, n))
            return
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self._params:
            self._seen[ptr] = st.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        return t

    @contextlib.contextmanager
    def forward(self):
        self._phase = "forward"
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            self._phase = "idle"

    @contextlib.contextmanager
    def backward(self):
        self._phase = "backward"
        try:
            yield self
        finally:
            self._phase = "idle"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def run(self, fn, args, kwargs):
        if self._phase == "forward":
            for t in _tensors((args, kwargs)):
                self._add(t)  # the checkpoint holds its inputs until the recompute

        def timed(*a, **k):
            if self._phase != "backward":
                return fn(*a, **k)
            self._sync()
            t0 = time.perf_counter()
            try:  # early-stopped recomputes leave by an exception: still count their time
                return fn(*a, **k)
            finally:
                self._sync()
                self.recompute_s += time.perf_counter() - t0
                self.recompute_calls += 1

        return checkpoint(timed, *args, use_reentrant=False, **kwargs)
