"""Tables, CSV files and plots of simulator runs."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from sagc_jax.sim.runner import SimRun
from sagc_jax.sim.steptime import REGIMES

# What each rollout regime's column is (sim/roofline.py): the sampler compacting its rows, the
# sampler before that (finished rows stay), vLLM-style continuous batching.
REGIME_TITLES = {
    "compacting": "compacting",
    "synchronous": "synchronous",
    "continuous": "continuous batching",
}


def _columns(timed: str, reference: str) -> tuple:
    """(key, title, format) of the table; the modeled hours name what they are of (``timed``:
    the model and hardware of the step-time model) and the rollout regime, the sampler's own
    (compacting) first."""
    hours = []
    for i, regime in enumerate(REGIMES):
        of = f"{timed}, " if i == 0 else ""
        hours.append((f"{regime}_h", f"modeled h, {of}{REGIME_TITLES[regime]}", "{:.2f}"))
        hours.append((f"{regime}_vs_ref", f"vs {reference}", "{:.2f}x"))
    return (
        ("controller", "controller", "{}"),
        ("straggler_rate", "straggler rate", "{:.3f}"),
        ("mean_G", "mean G", "{:.2f}"),
        ("mean_log2_G", "mean log2 G", "{:.2f}"),
        ("rollouts", "rollouts", "{:d}"),
        *hours,
        ("rollout_share", f"rollout share ({REGIMES[0]})", "{:.2f}"),
        ("padding_waste", "padding waste", "{:.3f}"),
    )


# tail-batched runs (runner.tail_summary); their straggler rate is the true one of the groups
# started, the controller's reading beside it
TAIL_COLUMNS = [
    ("read_straggler_rate", "straggler rate read (censored)", "{:.3f}"),
    ("deferred_share", "prompts deferred", "{:.3f}"),
    ("longest_deferral", "longest deferral (steps)", "{:d}"),
    ("long_rounds", "long rounds", "{:d}"),
    ("queue_left", "waiting at the end", "{:d}"),
]

# a workload with rewards (the synthetic one): the share of groups with a GRPO advantage (their
# rewards not all equal) and how many such groups a modeled hour buys (compacting)
SIGNAL_COLUMNS = [
    ("signal_share", "groups with signal", "{:.3f}"),
    ("signal_groups_per_h", f"groups with signal per modeled h ({REGIMES[0]})", "{:.0f}"),
]

# lambda of the plots: the paper's SAGC logs its multiplier, SAGC+ its linear program's price
PRICE_TITLE = "Straggler price (sagc: multiplier; sagc_plus: LP)"
REFERENCE = "fixed:16"


def delta_line(ax, delta: float) -> None:
    """The straggler budget ``delta`` as a dotted horizontal line labelled "delta", on every plot
    of straggler shares, rates or probabilities (simulator, ``report`` and ``compare`` plots)."""
    ax.axhline(delta, color="k", ls=":", label="delta")


def summary_rows(runs: list[SimRun], reference: str = REFERENCE) -> list[dict]:
    """Summaries with the modeled hours of each regime relative to ``reference``'s (nan when it
    was not run)."""
    rows = [run.summary() for run in runs]
    ref = next((r for r in rows if r["controller"] == reference), None)
    for row in rows:
        for regime in REGIMES:
            hours = ref[f"{regime}_h"] if ref else float("nan")
            row[f"{regime}_vs_ref"] = row[f"{regime}_h"] / hours if hours else float("nan")
    return rows


def format_table(
    rows: list[dict], timed: str, bootstrapped: bool = False, reference: str = REFERENCE
) -> str:
    """A markdown table, one row per controller; ``timed`` says what the modeled hours are of
    (``StepTimer.label``)."""
    cols = list(_columns(timed, reference)) + (
        [("bootstrapped_steps", "bootstrapped steps", "{:d}")] if bootstrapped else []
    )
    if any("signal_share" in row for row in rows):  # n/a for mixed group sizes (per_prompt)
        cols += SIGNAL_COLUMNS
    if rows and "deferred_share" in rows[0]:
        cols += TAIL_COLUMNS
    lines = [
        "| " + " | ".join(title for _, title, _ in cols) + " |",
        "|" + "|".join(" --- " for _ in cols) + "|",
    ]
    for row in rows:
        cells = []
        for key, _, fmt in cols:
            value = row.get(key, float("nan"))
            cells.append(
                "n/a" if isinstance(value, float) and np.isnan(value) else fmt.format(value)
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(runs: list[SimRun], rows: list[dict], out_dir: Path) -> list[Path]:
    """``summary.csv`` (one row per controller) and ``steps.csv`` (one row per controller-step)."""
    summary_path, steps_path = out_dir / "summary.csv", out_dir / "steps.csv"
    with summary_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    candidates = sorted({g for run in runs for g in run.candidates})
    with steps_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "controller",
                "step",
                "G",
                "s_t",
                "lambda",
                "padding_waste",
                "max_ratio",
                "mean_length",
                *(f"{regime}_rollout_s" for regime in REGIMES),
                "update_s",
            ]
            + [f"posterior_mean_G{g}" for g in candidates]
        )
        for run in runs:
            for t in range(len(run.group_size)):
                post = {g: run.posterior_mean[t, i] for i, g in enumerate(run.candidates)}
                writer.writerow(
                    [
                        run.name,
                        t,
                        f"{run.group_size[t]:.6g}",
                        f"{run.s_t[t]:.6g}",
                        f"{run.lam[t]:.6g}",
                        f"{run.padding_waste[t]:.6g}",
                        f"{run.max_ratio[t]:.6g}",
                        f"{run.mean_length[t]:.6g}",
                        *(f"{run.rollout_seconds[regime][t]:.6g}" for regime in REGIMES),
                        f"{run.update_seconds[t]:.6g}",
                    ]
                    + [
                        f"{post[g]:.6g}" if g in post and not np.isnan(post[g]) else ""
                        for g in candidates
                    ]
                )
    paths = [summary_path, steps_path]
    calibrated = [run for run in runs if run.calibration is not None]
    if calibrated:
        paths.append(write_calibration(calibrated, out_dir / "calibration.csv"))
    return paths


def write_calibration(runs: list[SimRun], path: Path) -> Path:
    """``calibration.csv``: per prompt-aware controller and bin of predicted straggle
    probability, the groups, their mean prediction and their observed straggle rate."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["controller", "bin_low", "groups", "mean_predicted", "observed_rate"])
        for run in runs:
            cal = run.calibration
            for i, low in enumerate(cal["bins"]):
                pred, obs = cal["mean_predicted"][i], cal["observed_rate"][i]
                writer.writerow(
                    [
                        run.name,
                        f"{low:.3g}",
                        int(cal["count"][i]),
                        "" if np.isnan(pred) else f"{pred:.4f}",
                        "" if np.isnan(obs) else f"{obs:.4f}",
                    ]
                )
    return path


def write_plots(runs: list[SimRun], out_dir: Path, delta: float) -> list[Path]:
    """PNG plots: G over steps, lambda, posterior means, running straggler rate, ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    adaptive = [r for r in runs if not np.all(np.isnan(r.posterior_mean))]

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in runs:
        ax.step(np.arange(len(run.group_size)), run.group_size, where="post", label=run.name)
    ax.set(xlabel="step", ylabel="G", yscale="log", title="Group size per step")
    ax.set_yticks(sorted({g for r in runs for g in r.candidates}))
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    save(fig, "group_size.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in adaptive:
        ax.plot(run.lam, label=run.name)
    ax.set(xlabel="step", ylabel="lambda", title=PRICE_TITLE)
    save(fig, "lambda.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in adaptive:
        for i, g in enumerate(run.candidates):
            ax.plot(run.posterior_mean[:, i], label=f"{run.name} G={g}")
    delta_line(ax, delta)
    ax.set(
        xlabel="step",
        ylabel="alpha / (alpha + beta)",
        ylim=(0, 1),
        title="Posterior mean straggler probability",
    )
    ax.legend(fontsize=8)
    save(fig, "posterior_mean.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in runs:
        ax.plot(np.cumsum(run.s_t) / np.arange(1, len(run.s_t) + 1), label=run.name)
    delta_line(ax, delta)
    ax.set(xlabel="step", ylabel="running mean of s_t", ylim=(0, 1), title="Running straggler rate")
    ax.legend(fontsize=8)
    save(fig, "straggler_rate.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run in runs:
        ratios = np.concatenate(run.group_ratios)
        ax.hist(np.clip(ratios, 1, 10), bins=60, histtype="step", density=True, label=run.name)
    ax.set(
        xlabel="group max / median (clipped at 10)",
        ylabel="density",
        title="Distribution of per-group max/median ratios",
    )
    ax.legend(fontsize=8)
    save(fig, "max_median_ratio.png")
    return paths
