"""Open-loop evaluation over whole episodes (`loongforge eval`), as GR00T's eval.

For each episode the samples are taken in time order and a horizon chunk is predicted every H
frames: the chunk is executed open-loop (no re-planning inside it) and compared with the
ground-truth actions of the same frames. Reported in the robot's absolute units (predictions decoded
by the run's processor: unnormalised, relative actions made absolute from the state), per action
key of the embodiment's modality config, so that skill is told apart from
sampling noise and from what the state alone gives: one flow sample, the mean of K samples (the
policy's default), the discrete-valued groups snapped to their training levels, and three
baselines: ridge-from-state fitted on the training episodes
(baselines.py), predict-the-mean and repeat-last (the last action before the chunk; for an
episode's first chunk, its first action: never the state, which for e.g. hand commands vs hand
joint positions is another quantity of the same width). Writes eval.json and one PNG per
episode (plots.py: the dimensions where the error is).
"""

from __future__ import annotations

import json
import os

import numpy as np

from loongforge.shared.errors import ConfigError, UsageError
from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.data.samples import SampleTable, sample_lengths
from loongforge.train.eval.baselines import action_groups, fit_reference
from loongforge.train.eval.plots import plot_episode
from loongforge.train.eval.validation import ValSet

# What the table compares, in its column order (only those computed appear):
#   policy     one flow sample (seed `seed`)
#   policy_k   the mean of `samples` flow samples (seeds seed..seed+K-1): Policy.predict_action's default
#   snap       `policy_k` with the discrete-valued groups snapped to their training levels
#   ridge      ridge regression from the current state, fitted on the training episodes (baselines.py)
#   mean       what a normalized 0 decodes to: the middle of each key's range (relative keys: on the state)
#   repeat_last  the last action before the chunk (the episode's first action for its first chunk)
METHODS = ("policy", "policy_k", "snap", "ridge", "mean", "repeat_last")
HEADERS = {"policy": "1 sample", "policy_k": "K-mean", "snap": "snap", "ridge": "ridge", "mean": "mean",
           "repeat_last": "repeat-last"}


def chunk_ids(data, episode_id: int) -> np.ndarray:
    """Sample ids of one episode whose action chunks tile its timeline: t = 0, H, 2H, ...
    (data: training_data.TrainingData). Empty when the episode is not in the root."""
    rows = np.flatnonzero(np.asarray(data.ds.tables["episode_id"]) == episode_id)
    if not len(rows):
        return np.zeros(0, np.int64)
    table = SampleTable(sample_lengths(data.ds.episode_lengths, data.deltas))
    row = int(rows[0])
    ts = np.arange(0, int(table.lengths[row]), data.deltas.action_horizon)
    return table.starts[row] + ts


def predict_chunks(policy, batch, *, steps: int, seed: int, samples: int = 1, ref=None,
                   discrete_dims=(), tag: str | None = None, cameras=None) -> dict[str, np.ndarray]:
    """(B, H, Da) robot-unit predictions of every method that needs the model or the reference. The K-sample
    mean is taken in the model's units, then decoded: what Policy.predict_action and `loongforge serve` give."""
    flows = policy.flows(batch, tag, cameras, steps, seed, max(1, samples))
    out = {"policy": policy.decode_concat(flows[0], batch["raw_state"], tag)}
    if samples > 1:
        out["policy_k"] = policy.decode_concat(flows.mean(axis=0), batch["raw_state"], tag)
    if ref is not None:
        state = batch["state"][:, -1].float().cpu().numpy()  # the current state token (the last of the K rows)
        out["ridge"] = policy.decode_concat(ref.ridge(state), batch["raw_state"], tag)
        if discrete_dims:
            out["snap"] = ref.snap(out.get("policy_k", out["policy"]), list(discrete_dims))
    return out


def evaluate_episode(policy, valset, *, steps: int = 4, seed: int = 0, samples: int = 1,
                     ref=None, discrete_dims=()) -> dict[str, np.ndarray]:
    """Concatenated (T, Da) trajectories of one episode: truth, the policy's variants, the baselines."""
    tag, cameras = valset.tag, valset.cameras
    da = policy.processor.state_action(tag).action_dim
    got: dict[str, list] = {"truth": [], "mean": [], "repeat_last": []}
    last = None
    for batch in valset.batches:
        preds = predict_chunks(policy, batch, steps=steps, seed=seed, samples=samples, ref=ref,
                               discrete_dims=discrete_dims, tag=tag, cameras=cameras)
        act = batch["raw_action"].cpu().numpy()  # the truth, robot units (absolute)
        # "mean": what a normalised 0 decodes to (the middle of each key's range; relative keys on the state)
        middle = policy.decode_concat(np.zeros(act.shape, np.float32), batch["raw_state"], tag)
        valid = batch["action_valid"].cpu().numpy()
        for i in range(len(act)):
            rows = valid[i]
            if last is None:
                last = act[i][0]
            got["truth"].append(act[i][rows])
            for name, pred in preds.items():
                got.setdefault(name, []).append(pred[i][rows])
            got["mean"].append(middle[i][rows])
            got["repeat_last"].append(np.broadcast_to(last, act[i][rows].shape))
            last = act[i][rows][-1] if rows.any() else last
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0, da), np.float32)
    return {k: cat(v) for k, v in got.items()}


def errors(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]]) -> dict:
    out = {}
    for m in (m for m in METHODS if m in traj):
        d = traj[m] - traj["truth"]
        out[m] = {"mse": {g: float(np.mean(d[:, a:b] ** 2)) for g, (a, b) in groups.items()},
                  "mae": {g: float(np.mean(np.abs(d[:, a:b]))) for g, (a, b) in groups.items()}}
        out[m]["mse"]["all"] = float(np.mean(d ** 2))
        out[m]["mae"]["all"] = float(np.mean(np.abs(d)))
    return out


def check_request(dataset, episodes: list[int] | None, steps: int, samples: int = 1) -> None:
    """What `run_eval` is asked, checked against the shard root before any checkpoint is loaded
    (dataset: shared.dataset.Dataset)."""
    if steps < 1:
        raise UsageError(f"--steps {steps}: the flow needs at least 1 integration step (GR00T uses 4)")
    if samples < 1:
        raise UsageError(f"--samples {samples}: the K-sample mean needs at least 1 noise seed (default 8)")
    if episodes:
        have = {int(e) for e in np.asarray(dataset.tables["episode_id"])}
        missing = sorted(set(episodes) - have)
        if missing:
            raise UsageError(f"--episodes: {missing} not in the shard root ({len(have)} episodes, ids "
                             f"{min(have)}..{max(have)})")


def run_eval(policy, data_root: str, out_dir: str, *, episodes: list[int] | None = None, steps: int = 4,
             seed: int = 0, samples: int = 8, plots: bool = True, plot_dims: int = 8) -> dict:
    """Open-loop evaluation of `policy` over `episodes` (default: the index's validation episodes)."""
    index = policy.index
    check_request(index.ds, episodes, steps, samples)
    eps = list(episodes) if episodes else list(index.val_episodes)
    if not eps:
        raise ConfigError("no episodes to evaluate: the index has no validation split (preprocess "
                          "--val-episodes 10%) and --episodes was not given")
    groups = action_groups(index)
    ref = fit_reference(index, groups, policy.processor)
    dims = ref.discrete_dims(groups)
    os.makedirs(out_dir, exist_ok=True)
    summary = {"episodes": {}, "groups": {g: list(r) for g, r in groups.items()}, "steps": steps, "seed": seed,
               "samples": samples, "discrete_groups": list(ref.discrete_groups), "ridge_samples": ref.samples}
    trajs = []
    for ep in eps:
        chosen = chunk_ids(index, ep)
        if not len(chosen):
            continue
        vs = ValSet(index, chosen, policy.prompts(index.dataset.tasks or {}, index.roots[0].tag), policy.processor,
                    batch_size=16, device=policy.device)
        traj = evaluate_episode(policy, vs, steps=steps, seed=seed, samples=samples, ref=ref, discrete_dims=dims)
        trajs.append(traj)
        errs = errors(traj, groups)
        summary["episodes"][str(ep)] = {"chunks": len(chosen), "steps": len(traj["truth"]), **errs}
        if plots:
            plot_episode(traj, groups, errs, os.path.join(out_dir, f"episode_{ep:06d}.png"),
                         f"episode {ep} (open loop, {steps} flow steps)", max_dims=plot_dims, samples=samples)
    if not trajs:
        raise ValueError(f"episodes {eps}: no samples in the index")
    summary["overall"] = errors({k: np.concatenate([t[k] for t in trajs]) for k in trajs[0]}, groups)
    write_bytes_atomic(os.path.join(out_dir, "eval.json"), json.dumps(summary, indent=2, sort_keys=True).encode())
    return summary


def format_table(summary: dict) -> str:
    """MSE per group (dataset units), one column per method; * marks a discrete-valued group."""
    ov = summary["overall"]
    methods = [m for m in METHODS if m in ov]
    disc = set(summary.get("discrete_groups", ()))
    k = summary.get("samples", 1)
    head = [HEADERS[m].replace("K", str(k)) for m in methods]
    lines = [f"{'MSE':<18}" + "".join(f"{h:>12}" for h in head)]
    for g in ov["policy"]["mse"]:
        name = g + (" *" if g in disc else "")
        lines.append(f"{name:<18}" + "".join(f"{ov[m]['mse'][g]:>12.5f}" for m in methods))
    if disc:
        lines.append(f"* discrete-valued on the training episodes: snap = the {k}-sample mean snapped to its levels")
    lines.append(f"Policy.predict_action's default: the {k}-sample mean (K-mean)"
                 + (", discrete-valued groups as the flow gives them" if disc else ""))
    return "\n".join(lines)

