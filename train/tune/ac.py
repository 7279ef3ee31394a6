"""`loongforge tune ac`: measured memory/recompute trade-offs, and the workload that it and
`loongforge tune batch` (batch.py) measure.

  loongforge tune ac --recipe small --memory-budget 300MiB [--data ROOT] [--json ac.json]
  loongforge tune batch --recipe small --memory-budget 2GiB --ac-every 4 [--json batch.json]

Both build the recipe's model (no DeepSpeed), take one real batch from the
loader (from --data with its default delta indices, or a synthetic shard root
written to a temp dir, sampled at 4 frames per camera), and measure single-rank
forward+backward steps:

- activation bytes: what autograd keeps for backward, counted exactly with
  saved_tensors_hooks deduplicated by storage (kernels/checkpointing.py SavedBytesProbe), so the
  figure is the same on CPU and GPU; on CUDA also the peak of
  torch.cuda.max_memory_allocated over the step;
- recompute: seconds spent re-running checkpointed blocks inside backward,
  timed directly (synchronized on CUDA), as a share of the step.

`tune ac` picks the N in {off, 1, 2, 4, 8} whose activation bytes fit the
budget at least recompute. `tune batch` searches the largest micro-batch per
frame count (exponential probe, then bisection) that fits the budget: on CPU
by measured activation bytes, on CUDA by real OOMs and the peak allocated.
The trainer takes the result with `--batch-plan FILE`.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time

import torch

from loongforge.shared.synthetic import make_synthetic_root
from loongforge.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from loongforge.train.data.loader import BlockLoader
from loongforge.train.data.prompt import build_prompts, load_tokenizer
from loongforge.train.data.training_data import load_training_data
from loongforge.train.kernels.checkpointing import SavedBytesProbe, apply_ac, block_lists
from loongforge.train.kernels.precision import train_dtype
from loongforge.train.model.build import build_model
from loongforge.train.model.noise import noise_for
from loongforge.train.recipes import plan_model
from loongforge.train.parallel.engine import pick_device
from loongforge.train.tune.results import FORMAT_VERSION

log = logging.getLogger(__name__)
AC_CHOICES = (0, 1, 2, 4, 8)  # 0 = off


# -- workload -----------------------------------------------------------------


class Workload:
    """The recipe's model on the device and one real batch from the loader."""

    def __init__(self, recipe: str, root: str | None, micro_batch: int, device: str = "auto", seed: int = 0,
                 precision: str = "auto", video_deltas: tuple[int, ...] | None = None, **model_overrides):
        self._tmp = None
        if root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="loongforge-tune-")
            root = _synthetic_root(self._tmp.name, micro_batch)
            video_deltas = video_deltas or SYNTHETIC_DELTAS
        # None: DataConfig's default, what `loongforge train --data ROOT` samples (K = len(video_deltas)).
        video_deltas = video_deltas or ()
        self.device = pick_device(device)
        index = _load_root(root, video_deltas)
        max_frames = index.max_frames
        plan = plan_model(TrainConfig(recipe=recipe, data=DataConfig(root=root, video_deltas=video_deltas),
                                      model=ModelConfig(**model_overrides), run=RunConfig(run_dir=root)), index)
        self.cfg = plan.model
        torch.manual_seed(seed)
        # The dtype DeepSpeed trains in (its bf16 mode casts the module; fp32 master weights live in
        # the optimizer, which tuning does not build).
        self.dtype = train_dtype(self.device, precision)
        self.model = build_model(self.cfg).to(self.device, self.dtype).train()
        self.processor, self.root = plan.processor, index.roots[0]
        self.base = _one_batch(root, index, self.device, plan)
        self.max_frames = max_frames
        tok, tasks = load_tokenizer(plan.tokenizer, self.cfg.image_token_index), index.dataset.tasks or {}
        tokens, cams = self.cfg.tokens_per_image(*plan.processor.cfg.image_size), len(index.dataset.cameras)
        self.prompt_for = lambda k: build_prompts(tok, tasks, images=cams * k, tokens_per_image=tokens)

    def batch(self, micro: int, frames: int | None = None):
        """A micro-batch of `micro` samples (the loaded ones repeated) capped at `frames` frames."""
        b = _cap_frames(self.base, frames, self.prompt_for(frames)) if frames else self.base
        b = _tile(b, micro)
        n = b["action"].shape[0]
        noise, u, crop = noise_for(0, 0, range(n), (n, self.cfg.action_horizon, self.cfg.max_action_dim), self.device)
        return self.processor(b, self.root.tag, self.root.cameras, crop), noise, u

    def loss(self, inputs, noise, u):
        return self.model(inputs, noise, u)["loss"]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


SYNTHETIC_DELTAS = (-3, -2, -1, 0)  # 4 frames per camera and sample on the synthetic root


def _synthetic_root(path: str, micro_batch: int) -> str:
    # 128x128 frames, 4 per sample (SYNTHETIC_DELTAS), 2 cameras: with the small recipe's 16-px patches a
    # sequence of 2*4*64 vision + 4 state + 32 text + action tokens.
    # one episode with 8 samples (or the micro batch's) under N1.6's sampling: its length less the H - 1
    # frames of the last chunk (the synthetic root's horizon, 4)
    make_synthetic_root(path, lengths=(max(8, micro_batch) + 3,), height=128, width=128, action_horizon=4)
    return path


def _load_root(root: str, video_deltas: tuple[int, ...]):
    """The root as the trainer sees it (train/data/training_data.py), sampled with `video_deltas`."""
    return load_training_data(DataConfig(root=root, video_deltas=video_deltas))


def _one_batch(root: str, index, device, plan) -> dict:
    n = min(8, index.num_samples)
    p, r = plan.processor, index.roots[0]
    loader = BlockLoader(root, dataset=index.ds, batch_size=n, device=device, deltas=index.deltas,
                         prompts=plan.prompts[0], image_mean=p.cfg.image_mean, image_std=p.cfg.image_std,
                         state_action=p.state_action(r.tag), keys=r.keys, cameras=r.cameras)
    with loader:
        batch = next(iter(loader))
    batch.pop("meta", None)
    return batch


def _map(obj, fn):
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return fn(obj)


def _tile(batch: dict, micro: int) -> dict:
    def tile(t):
        reps = -(-micro // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:micro].contiguous()

    return _map(batch, tile)


def _cap_frames(batch: dict, k: int, prompts) -> dict:
    # The loader's layout (batch.py): frames.<slot> (B, K, ...), state (B, K, S), frame_mask (B, K).
    # The prompt holds K frames' image tokens, so a capped batch gets a prompt of k frames' (the first
    # task's on every row: what tuning measures is the length, not the words).
    out = dict(batch)
    b, dev = batch["state"].shape[0], batch["state"].device
    out["task_tokens"] = torch.from_numpy(prompts.ids[:1]).to(dev).expand(b, -1).contiguous()
    out["task_mask"] = torch.from_numpy(prompts.mask[:1]).to(dev).expand(b, -1).contiguous()
    out["frames"] = {s: v[:, :k].contiguous() for s, v in batch["frames"].items()}
    out["state"] = batch["state"][:, :k].contiguous()
    out["frame_mask"] = batch["frame_mask"][:, :k].contiguous()
    return out


# -- measurement --------------------------------------------------------------


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(w: Workload, probe, micro: int, frames: int | None = None, backward: bool = True) -> dict:
    """One forward (+ backward) under the probe: saved bytes, step and recompute seconds, CUDA peak."""
    batch, noise, t = w.batch(micro, frames)
    w.model.zero_grad(set_to_none=True)
    probe.reset()
    cuda = w.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(w.device)
        base = torch.cuda.memory_allocated(w.device)
    _sync(w.device)
    t0 = time.perf_counter()
    with probe.forward():
        loss = w.loss(batch, noise, t)
    if backward:
        with probe.backward():
            loss.backward()
    _sync(w.device)
    row = {"saved_bytes": probe.saved_bytes, "step_s": time.perf_counter() - t0, "recompute_s": probe.recompute_s}
    del loss
    if cuda:
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(w.device) - base
    return row


def tune_ac(w: Workload, micro: int, budget: int, reps: int = 2, choices=AC_CHOICES) -> dict:
    probe = SavedBytesProbe(w.model)
    rows = []
    for every in choices:
        apply_ac(w.model, every, probe=probe)
        measure_step(w, probe, micro)  # warm-up: allocator, lazy inits
        runs = [measure_step(w, probe, micro) for _ in range(reps)]
        step = statistics.median(r["step_s"] for r in runs)
        rec = statistics.median(r["recompute_s"] for r in runs)
        row = {"every": every, "saved_bytes": runs[0]["saved_bytes"], "step_s": step, "recompute_s": rec,
               "recompute_pct": 100.0 * rec / step if step > 0 else 0.0}
        if "cuda_peak_bytes" in runs[0]:
            row["cuda_peak_bytes"] = max(r["cuda_peak_bytes"] for r in runs)
        rows.append(row)
    apply_ac(w.model, 0)
    off = next((r["saved_bytes"] for r in rows if r["every"] == 0), max(r["saved_bytes"] for r in rows))
    for r in rows:
        r["vs_off_pct"] = 100.0 * (r["saved_bytes"] - off) / off if off else 0.0
    return {"version": FORMAT_VERSION, "kind": "ac", "micro_batch": micro, "budget_bytes": budget,
            "device": str(w.device), "rows": rows, "choice": pick_ac(rows, budget)}


def pick_ac(rows: list[dict], budget: int) -> int | None:
    """The N whose activation bytes fit the budget at the least recompute (ties: fewer bytes)."""
    fits = [r for r in rows if r["saved_bytes"] <= budget]
    if not fits:
        return None
    return min(fits, key=lambda r: (r["recompute_pct"], r["saved_bytes"]))["every"]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_ac_table(result: dict) -> str:
    cuda = any("cuda_peak_bytes" in r for r in result["rows"])
    head = f"{'N':>4} {'act MiB':>9} {'vs off':>8} {'recompute %':>12} {'step s':>8}" + (
        f" {'cuda peak MiB':>14}" if cuda else "")
    lines = [head]
    for r in result["rows"]:
        line = (f"{r['every'] or 'off':>4} {_mib(r['saved_bytes']):>9} {r['vs_off_pct']:>+7.1f}% "
                f"{r['recompute_pct']:>12.1f} {r['step_s']:>8.3f}")
        if cuda:
            line += f" {_mib(r.get('cuda_peak_bytes', 0)):>14}"
        lines.append(line)
    c = result["choice"]
    budget = _mib(result["budget_bytes"])
    lines.append(f"budget {budget} MiB -> " + (f"--ac-every {c}" if c is not None else
                                                  "nothing fits: lower the micro-batch or raise the budget"))
    return "\n".join(lines)


@contextlib.contextmanager
def workload_from_args(a):
    w = Workload(a.recipe, a.data, a.micro_batch, device=a.device, seed=a.seed, precision=a.precision,
                 video_deltas=a.video_deltas)
    try:
        yield w
    finally:
        w.close()


def seq_len(w: Workload) -> int:
    """Tokens per sample in the first block list (the trunk): reported beside the table."""
    lists = block_lists(w.model)
    if not lists:
        return -1
    seen: list[int] = []
    hook = lists[0][1][0].register_forward_pre_hook(
        lambda m, args: seen.append(args[0].shape[1]) if args and getattr(args[0], "dim", lambda: 0)() >= 2 else None)
    try:
        with torch.no_grad():
            w.loss(*w.batch(1))
    finally:
        hook.remove()
    return seen[0] if seen else -1


