"""``sagc-jax compare``: the same task, warm start, seeds and step budget under each controller,
one run after the other on the same machine, summarised in one table with spread over seeds."""

from __future__ import annotations

import csv
import signal
from pathlib import Path

import numpy as np

from sagc_jax.config import Config, from_dict, parse_controller_spec, to_dict
from sagc_jax.train.faults import Interrupted, phase, resume_hint
from sagc_jax.train.loop import Trainer
from sagc_jax.train.report import plot_runs, read_metrics, summarize

COLUMNS = (
    ("wall_clock_s", "wall-clock (s)", "{:.0f}"),
    ("rollout_share", "rollout share", "{:.2f}"),
    ("straggler_rate", "straggler rate", "{:.3f}"),
    ("mean_G", "mean G", "{:.2f}"),
    ("mean_length", "mean length", "{:.1f}"),
    ("eval/accuracy", "held-out accuracy", "{:.3f}"),
    ("reward", "reward (last 10 steps)", "{:.3f}"),
)


def run_config(cfg: Config, spec: str, seed: int, steps: int | None) -> Config:
    """``cfg`` with the controller of ``spec``, seed offset ``seed`` and the step budget."""
    kind, group_size = parse_controller_spec(spec)
    data = to_dict(cfg)
    data["controller"]["kind"] = kind
    if group_size is not None:
        data["controller"]["group_size"] = group_size
    data["controller"]["sagc"]["seed"] = cfg.controller.sagc.seed + seed
    data["train"]["seed"] = cfg.train.seed + seed
    if steps is not None:
        data["train"]["steps"] = steps
    return from_dict(data)


def compare(
    cfg: Config,
    controllers: list[str],
    seeds: int,
    steps: int | None,
    out_dir: Path,
    progress: bool = True,
    log=print,
) -> list[dict]:
    """Run every (controller, seed); return one aggregated row per controller.

    Runs already in ``out_dir`` resume (or, finished, are only read). A stop signal ends the
    comparison (``Interrupted``): the run in progress saves a checkpoint when it is in its step
    loop, and the same command later continues from there.
    """
    per_run = {}
    hint = resume_hint(cfg, out_dir)
    for spec in controllers:
        for seed in range(seeds):
            name = f"{spec.replace(':', '')}-seed{seed}"
            run_dir = out_dir / name
            what = f"the {spec} run (seed {seed})"
            with phase(what, f"finished runs are kept in {out_dir}; {hint}"):
                with phase("start-up"):
                    trainer = Trainer(run_config(cfg, spec, seed, steps), run_dir)
                try:
                    done = "already done, " if trainer.finished else ""
                    resumed = f"resuming from step {trainer.step}, " if trainer.step else ""
                    log(f"compare: {spec}, seed {seed}: {done or resumed}{run_dir}")
                    summary = {} if trainer.finished else trainer.run(progress=progress)
                finally:
                    trainer.close()
                if summary.get("interrupted"):
                    raise Interrupted(
                        getattr(signal, summary["interrupted"]),
                        f"{what}, after step {summary['steps']}",
                        f"its checkpoint is saved in {run_dir}; {hint}",
                    )
            per_run[(spec, seed)] = read_metrics(run_dir)
    rows = []
    for spec in controllers:
        summaries = [summarize(*per_run[(spec, s)]) for s in range(seeds)]
        row = {"controller": spec, "seeds": seeds}
        for key, _, _ in COLUMNS:
            values = np.array([s.get(key, np.nan) for s in summaries], float)
            row[key] = float(values.mean())
            row[f"{key}_std"] = float(values.std(ddof=1)) if seeds > 1 else 0.0
        rows.append(row)
    plot_runs({spec: per_run[(spec, 0)] for spec in controllers}, out_dir)
    write_tables(rows, out_dir)
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown: mean over seeds, with +- the standard deviation when there are several."""
    head = "| controller | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            cell = fmt.format(row[key])
            if row["seeds"] > 1:
                cell += " +- " + fmt.format(row[f"{key}_std"])
            cells.append(cell)
        lines.append(f"| {row['controller']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(rows: list[dict], out_dir: Path) -> None:
    (out_dir / "compare.md").write_text(format_table(rows) + "\n")
    with (out_dir / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
