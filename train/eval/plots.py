"""The eval's per-episode figure: the action dimensions where the policy's error is, labelled by
their modality.json group, with the truth, the policy and the baselines that explain the error.

"The policy" here is what Policy.predict_action returns by default, the mean of K flow samples (the
console's table says so too): the panels are the dimensions where that prediction errs most and the
title gives its MSE per group beside the mean baseline's. The one-sample prediction is drawn, not
headlined (its MSE is the noise of one draw: worse than the mean baseline on an arm the K-mean fits).
"""

from __future__ import annotations

import numpy as np

# Drawn beside the truth and the default (headline) prediction when the trajectory has them.
LINES = (("policy", "policy, 1 sample", "tab:orange", "-"), ("ridge", "ridge(state)", "tab:purple", "--"),
         ("repeat_last", "repeat-last", "tab:gray", "--"))
LEGEND_PT = 9  # readable at the saved size (dpi 80); it was 6 pt and sat on the first panel's data


def headline_method(traj_or_errs: dict) -> str:
    """The prediction the figure is about: the K-sample mean where it was taken, else the one sample."""
    return "policy_k" if "policy_k" in traj_or_errs else "policy"


def worst_dims(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]], max_dims: int) -> list[tuple]:
    """(dim, label) of the `max_dims` dimensions with the largest squared error of the headline
    prediction, in dimension order; the label is `group[i]`, i counted inside the group."""
    err = ((traj[headline_method(traj)] - traj["truth"]) ** 2).sum(0)
    picked = sorted(np.argsort(-err, kind="stable")[:max_dims].tolist())
    label = {d: f"{g}[{d - a}]" for g, (a, b) in groups.items() for d in range(a, b)}
    return [(d, label.get(d, f"a[{d}]")) for d in picked]


def headline(errs: dict, groups: dict[str, tuple[int, int]], samples: int) -> str:
    """The title's error line: the default prediction's MSE per group, and the mean baseline's."""
    method = headline_method(errs)
    name = f"{samples}-sample mean" if method == "policy_k" else "1 sample"
    line = f"policy ({name}) MSE: " + ", ".join(f"{g} {errs[method]['mse'][g]:.3g}" for g in groups)
    if "mean" in errs:
        line += " | mean baseline: " + ", ".join(f"{g} {errs['mean']['mse'][g]:.3g}" for g in groups)
    return line


def episode_figure(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]], errs: dict, title: str,
                   max_dims: int = 8, samples: int = 1):
    """The figure (matplotlib, Agg) and its panel labels: one panel per chosen dimension (worst_dims),
    the legend beside the panels, never on them."""
    import matplotlib  # heavy, only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = worst_dims(traj, groups, max(1, max_dims))
    method = headline_method(traj)
    main = f"policy ({samples}-sample mean)" if method == "policy_k" else "policy (1 sample)"
    fig, axes = plt.subplots(len(dims), 1, figsize=(11, 1.5 * len(dims) + 1.2), sharex=True, squeeze=False)
    for ax, (d, label) in zip(axes[:, 0], dims):
        ax.plot(traj["truth"][:, d], label="true", color="black", lw=1.3)
        ax.plot(traj[method][:, d], label=main, color="tab:blue", lw=1.1)
        for key, name, color, style in LINES:
            if key in traj and key != method:
                ax.plot(traj[key][:, d], label=name, color=color, ls=style, lw=0.8)
        ax.set_ylabel(label, fontsize=9)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(0.79, 0.93), fontsize=LEGEND_PT, frameon=False)
    fig.suptitle(f"{title}\n{headline(errs, groups, samples)}", fontsize=9)
    axes[-1, 0].set_xlabel("step (open-loop chunks)")
    fig.tight_layout(rect=(0, 0, 0.78, 0.94))
    return fig, [label for _, label in dims]


def plot_episode(traj: dict[str, np.ndarray], groups: dict[str, tuple[int, int]], errs: dict, path: str,
                 title: str, max_dims: int = 8, samples: int = 1) -> list[str]:
    """episode_figure saved at `path`; returns the panel labels."""
    import matplotlib.pyplot as plt  # heavy, only for the plots

    fig, labels = episode_figure(traj, groups, errs, title, max_dims, samples)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return labels
