"""The completions page of a run's report (``sagc-jax report``): what the model wrote at the
first, middle and last logged steps, as markdown (``RUN/report/completions.md``): for a few
groups of each, the group's longest completion and one of its highest and one of its lowest
reward; and the completions' length against their reward over the run (``length_reward.png``).
It reads the rows the trainer wrote (``sagc_jax.train.completions``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from sagc_jax.analysis.run_report import figure_writer
from sagc_jax.train.completions import read_completions

PAGE, PLOT = "completions.md", "length_reward.png"


def picked_steps(steps: list[int]) -> list[int]:
    """The first, middle and last of the logged ``steps`` (fewer when fewer were logged)."""
    steps = sorted(set(steps))
    if not steps:
        return []
    return sorted({steps[0], steps[len(steps) // 2], steps[-1]})


def _reward(row: dict[str, Any]) -> float:
    return -np.inf if row["reward"] is None else row["reward"]


def group_examples(group: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(what it is, row) of a group's rows: the longest, a highest- and a lowest-reward
    completion (the first of ties), a completion that is two of them named once."""
    picks = {
        "longest": max(group, key=lambda r: r["length"]),
        "highest reward": max(group, key=_reward),
        "lowest reward": min(group, key=_reward),
    }
    labels: dict[int, list[str]] = {}
    for label, row in picks.items():
        labels.setdefault(id(row), []).append(label)
    seen, out = set(), []
    for row in picks.values():
        if id(row) not in seen:
            seen.add(id(row))
            out.append((", ".join(labels[id(row)]), row))
    return out


def _fenced(text: str) -> list[str]:
    """``text`` as a fenced block that no run of tildes in it can close."""
    longest = max((len(run) for run in re.findall(r"~+", text)), default=0)
    fence = "~" * max(3, longest + 1)
    return [f"{fence}text", text, fence]


def _number(x: float | None, spec: str) -> str:
    return "null" if x is None else format(x, spec)


def completions_page(rows: list[dict[str, Any]], title: str, groups: int = 3) -> str:
    """The markdown page of ``rows`` (a run's completions): at each of :func:`picked_steps`,
    the examples of the first ``groups`` groups logged."""
    steps = sorted({r["step"] for r in rows})
    lines = [
        f"# Completions of {title}",
        "",
        f"What the model wrote at the first, middle and last of the {len(steps)} logged steps "
        f'(from `completions/`; the fields: docs/metrics.md, "Completions"): for '
        f"{groups} groups of each, the group's longest completion and one of its highest and "
        f"lowest reward. Length against reward over the run: [{PLOT}]({PLOT}).",
    ]
    for step in picked_steps(steps):
        at = [r for r in rows if r["step"] == step]
        lines += ["", f"## Step {step} (G = {at[0]['step_G']})"]
        for group in sorted({r["group"] for r in at})[:groups]:
            members = sorted((r for r in at if r["group"] == group), key=lambda r: r["sample"])
            first = members[0]
            lines += [
                "",
                f"### Group {group}: prompt {first['prompt_id']}, G = {first['G']}, answer "
                f"`{first['answer']}`",
                "",
                f"Prompt ({first['prompt_tokens']} tokens):",
                *_fenced(first["prompt_text"]),
            ]
            for label, row in group_examples(members):
                cut = ", cut at the limit" if row["truncated"] else ""
                trained = "trained" if row["trained"] else "not trained"
                lines += [
                    "",
                    f"**{label}** (sample {row['sample']}): {row['length']} tokens{cut}; reward "
                    f"{_number(row['reward'], '.3g')} (raw {_number(row['reward_raw'], '.3g')}), "
                    f"advantage {_number(row['advantage'], '+.3f')}, {trained}",
                    *_fenced(row["completion_text"]),
                ]
    return "\n".join(lines) + "\n"


def plot_length_reward(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """``out_dir/length_reward.png``: the mean completion length and mean reward of each logged
    step, and every completion's length against its reward coloured by step, titled with their
    correlation."""
    plt, save, _ = figure_writer(out_dir)
    rows = [r for r in rows if r["reward"] is not None]
    step_r = np.array([r["step"] for r in rows])
    length_r = np.array([r["length"] for r in rows], float)
    reward_r = np.array([r["reward"] for r in rows], float)
    steps = np.unique(step_r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1.plot(steps, [length_r[step_r == s].mean() for s in steps], marker="o", color="tab:blue")
    ax1.set(xlabel="step", title="Logged completions: mean length and reward")
    ax1.set_ylabel("mean length (tokens)", color="tab:blue")
    right = ax1.twinx()
    right.plot(steps, [reward_r[step_r == s].mean() for s in steps], marker="s", color="tab:red")
    right.set_ylabel("mean reward", color="tab:red")
    points = ax2.scatter(length_r, reward_r, c=step_r, cmap="viridis", s=12, alpha=0.6)
    fig.colorbar(points, ax=ax2, label="step")
    varied = len(rows) > 1 and length_r.std() > 0 and reward_r.std() > 0
    corr = f"correlation {np.corrcoef(length_r, reward_r)[0, 1]:+.2f}" if varied else "no spread"
    ax2.set(
        xlabel="completion length (tokens)",
        ylabel="reward",
        title=f"Length against reward, {len(rows)} completions ({corr})",
    )
    save(fig, PLOT)
    return out_dir / PLOT


def write_completions_report(run_dir: Path, out_dir: Path) -> Path | None:
    """The page and its plot in ``out_dir`` from ``run_dir``'s completions; the page's path,
    None when the run wrote none."""
    rows = read_completions(run_dir)
    if not rows:
        return None
    plot_length_reward(rows, out_dir)
    page = out_dir / PAGE
    page.write_text(completions_page(rows, run_dir.name), encoding="utf-8")
    return page
