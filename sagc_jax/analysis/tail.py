"""The length tail of many completions per prompt (``sagc-jax eval --samples K --completions``):
what a synchronous GRPO step of group size G would meet if each prompt's K completions were cut
into groups of G, and the completions written out one per line, with a histogram of their
lengths."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from sagc_jax.controller import varied_groups
from sagc_jax.controller.observation import group_ratios


def tail_summary(
    lengths_pk: np.ndarray, rewards_pk: np.ndarray, cap: int, groups, tau: float
) -> dict:
    """Figures of ``[prompts, samples]`` completion lengths (tokens) and rewards under a cap of
    ``cap`` new tokens.

    Over every completion: the median, mean and 90th/99th percentiles of the length, the share at
    the cap, the share solved (reward >= 1); per prompt: the share of prompts none of whose
    completions is right and of those all of whose are. For each G of ``groups`` that is at most
    the samples per prompt, the samples of a prompt cut in order into groups of G (the rest left
    out): ``straggle@G``, the share of groups whose longest completion is over ``tau`` times
    their median (the controller's straggler test); ``no_signal@G``, the share of groups whose
    rewards are all equal (advantage 0 for every row); ``sync_decode@G``, the tokens a
    synchronous step decodes (every row of a group until its longest) over the real ones.
    """
    lengths_pk = np.asarray(lengths_pk, np.float64)
    rewards_pk = np.asarray(rewards_pk, np.float64)
    prompts, samples = lengths_pk.shape
    right_pk = rewards_pk >= 1.0
    out = {
        "completions": int(lengths_pk.size),
        "prompts": prompts,
        "samples": samples,
        "cap": cap,
        "length_median": float(np.median(lengths_pk)),
        "length_mean": float(lengths_pk.mean()),
        "length_p90": float(np.percentile(lengths_pk, 90)),
        "length_p99": float(np.percentile(lengths_pk, 99)),
        "at_cap": float(np.mean(lengths_pk >= cap)),
        "solved": float(right_pk.mean()),
        "prompts_none_solved": float(np.mean(~right_pk.any(axis=1))),
        "prompts_all_solved": float(np.mean(right_pk.all(axis=1))),
    }
    for g in sorted(g for g in set(groups) if 1 < g <= samples):
        used = samples // g * g
        lengths_ng = lengths_pk[:, :used].reshape(-1, g)
        rewards_ng = rewards_pk[:, :used].reshape(-1, g)
        out[f"straggle@{g}"] = float(np.mean(group_ratios(lengths_ng) > tau))
        out[f"no_signal@{g}"] = 1.0 - float(np.mean(varied_groups(rewards_ng)))
        out[f"sync_decode@{g}"] = float(g * lengths_ng.max(axis=1).sum() / lengths_ng.sum())
    return out


def write_completions(path: Path, completions, tail: dict, chars: int = 2000) -> Path:
    """One JSON line per completion at ``path`` (``prompt``, ``sample``, ``length``,
    ``reward``, ``truncated``; with the texts, also ``prompt_id``, ``prompt_text``,
    ``completion_text``, ``answer`` and ``accepted``, texts capped at ``chars`` characters as a
    run's are), written whole or not at all, and the histogram of the lengths beside it
    (``path`` with the suffix ``.png``, titled with ``tail``'s figures); the plot's path.
    ``completions``: `sagc_jax.train.evaluate.HeldoutCompletions`."""
    from sagc_jax.train.completions import capped

    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    texts_pk = completions.texts_pk
    with open(tmp, "w", encoding="utf-8") as f:
        for (p, k), length in np.ndenumerate(completions.lengths_pk):
            reward = float(completions.rewards_pk[p, k])
            record = {
                "prompt": p,
                "sample": k,
                "length": int(length),
                "reward": reward,
                "truncated": bool(completions.truncated_pk[p, k]),
            }
            if texts_pk is not None:
                prompt = completions.prompts[p]
                record.update(
                    prompt_id=int(prompt.id),
                    prompt_text=capped(prompt.text, chars),
                    completion_text=capped(texts_pk[p][k], chars),
                    answer=capped(prompt.answer, chars),
                    accepted=reward >= 1.0,  # as eval/accuracy counts it
                )
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return plot_lengths(completions.lengths_pk, tail, path.with_suffix(".png"))


def plot_lengths(lengths_pk: np.ndarray, tail: dict, path: Path) -> Path:
    """Histogram of the completion lengths (log count: the tail stays visible) with the median
    and the cap marked, titled with the share at the cap and the straggle rates; ``path``."""
    from sagc_jax.analysis.run_report import figure_writer

    plt, save, _ = figure_writer(path.parent)
    fig, ax = plt.subplots(figsize=(7, 4))
    cap = tail["cap"]
    ax.hist(np.ravel(lengths_pk), bins=np.linspace(0, cap + 1, 65), color="tab:blue")
    ax.set_yscale("log")
    ax.axvline(tail["length_median"], color="k", ls="--", label=f"median {tail['length_median']:g}")
    ax.axvline(cap, color="tab:red", ls=":", label=f"cap {cap}")
    ax.set_xlabel("completion length (tokens, EOS included)")
    ax.set_ylabel("completions (log)")
    straggle = ", ".join(
        f"G={key.split('@')[1]}: {value:.2f}" for key, value in tail.items() if "straggle@" in key
    )
    ax.set_title(
        f"{tail['completions']} completions of {tail['prompts']} prompts; "
        f"{tail['at_cap']:.1%} at the cap\nstraggling groups: {straggle or 'no G fits'}",
        fontsize=9,
    )
    ax.legend()
    save(fig, path.name)
    return path


TABLE_COLUMNS = (
    ("length_median", "median", "{:.0f}"),
    ("length_mean", "mean", "{:.1f}"),
    ("length_p90", "p90", "{:.0f}"),
    ("at_cap", "at the cap", "{:.1%}"),
    ("solved", "solved", "{:.1%}"),
    ("prompts_none_solved", "prompts none solved", "{:.0%}"),
    ("straggle@4", "straggle G=4", "{:.2f}"),
    ("straggle@8", "G=8", "{:.2f}"),
    ("straggle@16", "G=16", "{:.2f}"),
    ("no_signal@4", "no signal G=4", "{:.2f}"),
    ("no_signal@8", "G=8", "{:.2f}"),
    ("no_signal@16", "G=16", "{:.2f}"),
    ("sync_decode@16", "sync decode G=16", "{:.1f}x"),
)


def tail_table(out_dir: Path) -> str:
    """A markdown table of every ``*.json`` that ``sagc-jax eval --out --completions`` wrote in
    ``out_dir`` (one row per file, named by its stem; its ``tail/*`` figures, "-" where one is
    missing)."""
    head = "| setting | " + " | ".join(label for _, label, _ in TABLE_COLUMNS) + " |"
    rows = [head, "|" + " --- |" * (len(TABLE_COLUMNS) + 1)]
    for path in sorted(Path(out_dir).glob("*.json")):
        record = json.loads(path.read_text())
        cells = [
            fmt.format(record[f"tail/{key}"]) if f"tail/{key}" in record else "-"
            for key, _, fmt in TABLE_COLUMNS
        ]
        rows.append(f"| {path.stem} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
