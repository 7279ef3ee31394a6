"""The eval's per-episode figure: the action dimensions where the policy's error is, labelled by
their modality.json group, with the truth, the policy and the baselines that explain the error."""

from __future__ import annotations

import numpy as np

# Drawn beside the truth and the one-sample policy when the trajectory has them.
LINES = (("policy_k", "K-sample mean", "tab:blue", "-"), ("ridge", "ridge(state)", "tab:purple", "--"),
         ("repeat_last", "repeat-last", "tab:gray", "--"))


def worst_dims(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]], max_dims: int) -> list[tuple]:
    """(dim, label) of the `max_dims` dimensions with the largest squared error of the policy,
    in dimension order; the label is `group[i]`, i counted inside the group."""
    err = ((traj["policy"] - traj["truth"]) ** 2).sum(0)
    picked = sorted(np.argsort(-err, kind="stable")[:max_dims].tolist())
    label = {d: f"{g}[{d - a}]" for g, (a, b) in groups.items() for d in range(a, b)}
    return [(d, label.get(d, f"a[{d}]")) for d in picked]


def plot_episode(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]], errs: dict, path: str,
                 title: str, max_dims: int = 8) -> list[str]:
    """One panel per chosen dimension (worst_dims); returns the panel labels."""
    import matplotlib  # heavy, only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = worst_dims(traj, groups, max(1, max_dims))
    fig, axes = plt.subplots(len(dims), 1, figsize=(9, 1.5 * len(dims) + 1.0), sharex=True, squeeze=False)
    for ax, (d, label) in zip(axes[:, 0], dims):
        ax.plot(traj["truth"][:, d], label="true", color="black", lw=1.3)
        ax.plot(traj["policy"][:, d], label="policy (1 sample)", color="tab:orange", lw=1.0)
        for key, name, color, style in LINES:
            if key in traj:
                ax.plot(traj[key][:, d], label=name, color=color, ls=style, lw=0.8)
        ax.set_ylabel(label, fontsize=8)
    axes[0, 0].legend(loc="upper right", fontsize=6, ncol=3)
    per_group = ", ".join(f"{g} {errs['policy']['mse'][g]:.3g}" for g in groups)
    axes[0, 0].set_title(f"{title}\npolicy MSE per group: {per_group}", fontsize=8)
    axes[-1, 0].set_xlabel("step (open-loop chunks)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [label for _, label in dims]
