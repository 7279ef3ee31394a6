"""Open-loop evaluation over whole validation episodes (`loongforge eval`), as GR00T's eval.

For each episode the samples are taken in time order and a horizon chunk is predicted every H
frames: the chunk is executed open-loop (no re-planning inside it) and compared with the
ground-truth actions of the same frames. Reported in dataset units, per action group of the
dataset's modality.json (one group "action" when it has none): MSE and MAE for the policy and
for two trivial baselines, predict-the-mean (the index's action mean) and repeat-last (the last
action before the chunk; for an episode's first chunk, which has none, its first action: the
command in effect at the start; never the state, which for e.g. hand commands vs hand joint
positions is another quantity of the same width). Writes eval.json and one PNG per episode (predicted vs true trajectories).
"""

from __future__ import annotations

import json
import os

import numpy as np
from loongforge.shared.errors import ConfigError, UsageError
from loongforge.shared.storage import write_bytes_atomic
from loongforge.train.data.samples import SampleTable
from loongforge.train.eval.validation import ValSet

METHODS = ("policy", "mean", "repeat_last")


def action_groups(index) -> dict[str, tuple[int, int]]:
    groups = index.dataset.modality.get("action", {}) if isinstance(index.dataset.modality, dict) else {}
    out = {name: (int(g["start"]), int(g["end"])) for name, g in groups.items()
           if isinstance(g, dict) and "start" in g and "end" in g}
    return out or {"action": (0, index.dataset.action_dim)}


def chunk_ids(data, episode_id: int) -> np.ndarray:
    """Sample ids of one episode whose action chunks tile its timeline: t = 0, H, 2H, ...
    (data: training_data.TrainingData). Empty when the episode is not in the root."""
    rows = np.flatnonzero(np.asarray(data.ds.tables["episode_id"]) == episode_id)
    if not len(rows):
        return np.zeros(0, np.int64)
    table = SampleTable(np.asarray(data.ds.episode_lengths))
    row = int(rows[0])
    ts = np.arange(0, int(table.lengths[row]), data.deltas.action_horizon)
    return table.starts[row] + ts


def evaluate_episode(policy, valset, *, steps: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Concatenated (T, Da) trajectories of one episode: truth, policy and the baselines."""
    norm, ds = policy.norm, policy.index.dataset
    truth, pred, mean, last_rep = [], [], [], []
    last = None
    for batch in valset.batches:
        out = policy.unnormalize(policy.model.predict_action(batch, steps=steps, seed=seed))
        act = batch["action"].cpu().numpy() * norm.action_std + norm.action_mean
        valid = batch["action_valid"].cpu().numpy()
        for i in range(len(out)):
            rows = valid[i]
            if last is None:
                last = act[i][0]
            truth.append(act[i][rows])
            pred.append(out[i][rows])
            mean.append(np.broadcast_to(norm.action_mean, act[i][rows].shape))
            last_rep.append(np.broadcast_to(last, act[i][rows].shape))
            last = act[i][rows][-1] if rows.any() else last
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0, ds.action_dim), np.float32)
    return {"truth": cat(truth), "policy": cat(pred), "mean": cat(mean), "repeat_last": cat(last_rep)}


def errors(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]]) -> dict:
    out = {}
    for m in METHODS:
        d = traj[m] - traj["truth"]
        out[m] = {"mse": {g: float(np.mean(d[:, a:b] ** 2)) for g, (a, b) in groups.items()},
                  "mae": {g: float(np.mean(np.abs(d[:, a:b]))) for g, (a, b) in groups.items()}}
        out[m]["mse"]["all"] = float(np.mean(d ** 2))
        out[m]["mae"]["all"] = float(np.mean(np.abs(d)))
    return out


def plot_episode(traj: dict[str, np.ndarray], path: str, title: str, max_dims: int = 8) -> None:
    import matplotlib  # heavy, only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = min(max_dims, traj["truth"].shape[1])
    fig, axes = plt.subplots(dims, 1, figsize=(8, 1.6 * dims + 0.6), sharex=True, squeeze=False)
    for d in range(dims):
        ax = axes[d, 0]
        ax.plot(traj["truth"][:, d], label="true", color="black", lw=1.2)
        ax.plot(traj["policy"][:, d], label="predicted", color="tab:orange", lw=1.0)
        ax.set_ylabel(f"a[{d}]", fontsize=8)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[0, 0].set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("step (open-loop chunks)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def check_request(dataset, episodes: list[int] | None, steps: int) -> None:
    """What `run_eval` is asked, checked against the shard root before any checkpoint is loaded
    (dataset: shared.dataset.Dataset)."""
    if steps < 1:
        raise UsageError(f"--steps {steps}: the flow needs at least 1 integration step (GR00T uses 4)")
    if episodes:
        have = {int(e) for e in np.asarray(dataset.tables["episode_id"])}
        missing = sorted(set(episodes) - have)
        if missing:
            raise UsageError(f"--episodes: {missing} not in the shard root ({len(have)} episodes, ids "
                             f"{min(have)}..{max(have)})")


def run_eval(policy, data_root: str, out_dir: str, *, episodes: list[int] | None = None, steps: int = 4,
             seed: int = 0, plots: bool = True) -> dict:
    """Open-loop evaluation of `policy` over `episodes` (default: the index's validation episodes)."""
    index = policy.index
    check_request(index.ds, episodes, steps)
    eps = list(episodes) if episodes else list(index.val_episodes)
    if not eps:
        raise ConfigError("no episodes to evaluate: the index has no validation split (preprocess "
                          "--val-episodes 10%) and --episodes was not given")
    groups = action_groups(index)
    os.makedirs(out_dir, exist_ok=True)
    summary, trajs = {"episodes": {}, "groups": {g: list(r) for g, r in groups.items()}}, []
    for ep in eps:
        chosen = chunk_ids(index, ep)
        if not len(chosen):
            continue
        vs = ValSet(index, chosen, batch_size=16, text_len=policy.text_len, device=policy.device,
                    image_mean=policy.image_mean, image_std=policy.image_std)
        traj = evaluate_episode(policy, vs, steps=steps, seed=seed)
        trajs.append(traj)
        summary["episodes"][str(ep)] = {"chunks": len(chosen), "steps": len(traj["truth"]), **errors(traj, groups)}
        if plots:
            plot_episode(traj, os.path.join(out_dir, f"episode_{ep:06d}.png"), f"episode {ep} (open loop)")
    if not trajs:
        raise ValueError(f"episodes {eps}: no samples in the index")
    summary["overall"] = errors({k: np.concatenate([t[k] for t in trajs]) for k in trajs[0]}, groups)
    write_bytes_atomic(os.path.join(out_dir, "eval.json"), json.dumps(summary, indent=2, sort_keys=True).encode())
    return summary


def format_table(summary: dict) -> str:
    ov = summary["overall"]
    groups = list(ov["policy"]["mse"])
    lines = [f"{'group':<16}" + "".join(f"{m + ' MSE':>18}" for m in METHODS) + f"{'policy MAE':>14}"]
    for g in groups:
        lines.append(f"{g:<16}" + "".join(f"{ov[m]['mse'][g]:>18.5f}" for m in METHODS)
                     + f"{ov['policy']['mae'][g]:>14.5f}")
    return "\n".join(lines)

