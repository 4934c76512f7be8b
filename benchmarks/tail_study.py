"""The table of docs/experiments/tail-batching.md from the runs of its two `compare` commands:
fixed G = 16 and SAGC+ without tail batching (`runs/experiment/grpo`, make experiment's GRPO
runs) and with it (`runs/experiment/tail/on`), on the same seeds.

Per arm (mean ± 95% CI over seeds): the study's measures (``analysis.study``: final accuracy,
wall-clock and modeled time, time to target at 90% of fixed G = 16's mean final accuracy,
straggler rate, mean G, final length), the paired differences on the same seeds, and for the
tail-batched arms: the share of started prompts deferred, the longest wait of a trained prompt
(steps), long rounds, and the mean length of the completions trained (kept groups) against all
those started.

    .venv/bin/python benchmarks/tail_study.py [--seeds 5] [--runs runs/experiment]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from sagc_jax.analysis.compare import format_tables
from sagc_jax.analysis.study import mean_ci, study
from sagc_jax.config import load_config
from sagc_jax.planning.timing import step_timer
from sagc_jax.train.metrics import read_metrics

ARMS = {  # name in the table: (directory under --runs, run name prefix)
    "fixed:16": ("grpo", "fixed16"),
    "sagc_plus": ("grpo", "sagc_plus"),
    "tail+fixed:16": ("tail/on", "fixed16"),
    "tail+sagc_plus": ("tail/on", "sagc_plus"),
}


def _ci(values, fmt="{:.3f}") -> str:
    mean, half, _ = mean_ci(values)
    return fmt.format(mean) + (f" ± {fmt.format(half)}" if half == half and half else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--runs", default="runs/experiment")
    args = parser.parse_args()
    cfg = load_config("configs/experiments/straggler.yaml")
    timer = step_timer(cfg, max(cfg.sampling.prompt_buckets) + cfg.sampling.max_new_tokens)
    per_run = {
        (arm, seed): read_metrics(Path(args.runs) / where / f"{prefix}-seed{seed}")
        for arm, (where, prefix) in ARMS.items()
        for seed in range(args.seeds)
    }
    print(format_tables(study(per_run, list(ARMS), args.seeds, timer)))
    print(
        "\n| arm | prompts deferred (share of started) | longest wait (steps) | long rounds | "
        "trained length | started length |\n| --- | --- | --- | --- | --- | --- |"
    )
    for arm in ARMS:
        runs = [per_run[(arm, seed)][0] for seed in range(args.seeds)]
        # trained: the update batch's rollouts; started: every rollout, a cut one at the length
        # it reached (the runs without tail batching train every rollout they start; the
        # metric is newer than make experiment's runs)
        trained = [
            np.mean([r.get("length/trained_mean", r["length/mean"]) for r in steps])
            for steps in runs
        ]
        started = [np.mean([r["length/mean"] for r in steps]) for steps in runs]
        if arm.startswith("tail+"):
            deferred = _ci(
                [
                    sum(r["tail/deferred"] for r in steps)
                    / sum(r["tail/prompts_started"] for r in steps)
                    for steps in runs
                ]
            )
            waits = str(max(max(r["tail/waited_max"] for r in steps) for steps in runs))
            rounds = _ci([steps[-1]["tail/long_rounds"] for steps in runs], "{:.1f}")
        else:
            deferred, waits, rounds = "0", "0", "0"
        print(
            f"| {arm} | {deferred} | {waits} | {rounds} | {_ci(trained, '{:.1f}')} | "
            f"{_ci(started, '{:.1f}')} |"
        )


if __name__ == "__main__":
    main()
