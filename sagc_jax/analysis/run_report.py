"""Plots of training runs, read from their ``metrics.jsonl`` (finished or not; the records and
their summary: ``sagc_jax.train.metrics``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sagc_jax.sim.report import PRICE_TITLE, delta_line


def figure_writer(out_dir: Path):
    """(pyplot on the Agg backend, ``save(fig, name)`` that writes ``out_dir/name`` as a PNG and
    closes the figure, the list of paths written so far)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)

    return plt, save, paths


def candidate_labels(candidates: tuple[int, ...], k: int) -> list[str]:
    """Legend labels of a posterior of ``k`` entries, one per candidate in ladder order:
    "G=4", "G=8", ... from the run's ``candidates``; "rung 0", ... when they are not known
    (no saved config) or do not match ``k``."""
    if len(candidates) == k:
        return [f"G={g}" for g in candidates]
    return [f"rung {i}" for i in range(k)]


def plot_runs(
    runs: dict[str, tuple[list[dict], list[dict]]],
    out_dir: Path,
    candidates: tuple[int, ...] = (),
    delta: float | None = None,
) -> list[Path]:
    """PNGs over all named runs: accuracy and reward against wall-clock, G and lambda over
    steps, posterior mean per candidate, the straggler share per step and its running rate, and
    the distribution of group max/median ratios. ``candidates`` (the controller's ladder) names
    the posterior's entries; ``delta`` (the straggler budget) is drawn on the straggler plots;
    both from the runs' config (``controller.candidates``, ``controller.delta``), None/() when
    unknown."""
    plt, save, paths = figure_writer(out_dir)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, (steps, evals) in runs.items():
        clock = np.concatenate([[0.0], np.cumsum([r["time/step_s"] for r in steps])])
        at = {int(r["step"]): clock[min(int(r["step"]), len(clock) - 1)] for r in evals}
        ax1.plot(
            [at[int(r["step"])] for r in evals],
            [r["eval/accuracy"] for r in evals],
            marker="o",
            label=name,
        )
        ax2.plot(clock[1:], [r["reward"] for r in steps], label=name, alpha=0.8)
    ax1.set(xlabel="wall-clock (s)", ylabel="held-out accuracy", title="Held-out accuracy")
    ax2.set(xlabel="wall-clock (s)", ylabel="mean reward", title="Training reward")
    ax1.legend(fontsize=8)
    save(fig, "accuracy_reward_vs_time.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, (steps, _) in runs.items():
        x = [r["step"] for r in steps]
        ax1.step(x, [r["group_size"] for r in steps], where="post", label=name)
        ax2.plot(x, [r["controller/lambda"] for r in steps], label=name)
    ax1.set(xlabel="step", ylabel="G", title="Group size")
    ax2.set(xlabel="step", ylabel="lambda", title=PRICE_TITLE)
    ax1.legend(fontsize=8)
    save(fig, "group_size_lambda.png")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for name, (steps, _) in runs.items():
        logged = [r for r in steps if "controller/posterior_mean" in r]
        if logged:
            x = [r["step"] for r in logged]
            post = np.array([r["controller/posterior_mean"] for r in logged])
            for i, label in enumerate(candidate_labels(candidates, post.shape[1])):
                ax.plot(x, post[:, i], label=f"{name} {label}")
    if ax.get_legend_handles_labels()[0]:  # fixed-G runs have no posterior
        if delta is not None:
            delta_line(ax, delta)
        ax.legend(fontsize=7)
    ax.set(
        xlabel="step",
        ylabel="alpha / (alpha + beta)",
        ylim=(0, 1),
        title="Posterior mean straggler probability per candidate",
    )
    save(fig, "posterior_mean.png")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for name, (steps, _) in runs.items():
        x = [r["step"] for r in steps]
        s_t = np.array([r["controller/s_t"] for r in steps], float)
        (line,) = ax.plot(x, np.cumsum(s_t) / np.arange(1, len(s_t) + 1), label=name)
        ax.plot(x, s_t, color=line.get_color(), alpha=0.25, lw=1)
    if delta is not None:
        delta_line(ax, delta)
    ax.set(
        xlabel="step",
        ylabel="share of groups",
        ylim=(0, 1),
        title="Running straggler rate (faint: the step's straggler share s_t)",
    )
    ax.legend(fontsize=8)
    save(fig, "straggler_rate.png")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for name, (steps, _) in runs.items():
        ratios = np.concatenate([np.asarray(r["group_ratios"], float) for r in steps])
        ax.hist(np.clip(ratios, 1, 10), bins=50, histtype="step", density=True, label=name)
    ax.set(
        xlabel="group max / median length (clipped at 10)",
        ylabel="density",
        title="Max/median ratios",
    )
    ax.legend(fontsize=8)
    save(fig, "max_median_ratio.png")
    return paths
