"""``sagc-jax report``: summary and plots of one run, finished or still training."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import UserError
from sagc_jax.config import ConfigError, from_dict


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="summary and plots of one run (finished or running)",
        description="Writes RUN/report/: the plots of metrics.jsonl and, when the run wrote "
        "completions (logging.completions_every), completions.md (the longest, a highest- and "
        "a lowest-reward completion of a few groups at the first, middle and last logged "
        "steps) and length_reward.png.",
    )
    p.add_argument("run_dir", type=Path, help="a sagc-jax train run directory")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from sagc_jax.analysis.completions import write_completions_report
    from sagc_jax.analysis.run_report import plot_runs
    from sagc_jax.train.metrics import read_metrics, summarize

    try:
        steps, evals = read_metrics(args.run_dir)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    summary = summarize(steps, evals)
    if steps:
        candidates, delta = _run_ladder_and_budget(args.run_dir)
        plot_runs({args.run_dir.name: (steps, evals)}, args.run_dir / "report", candidates, delta)
    print(
        f"report {args.run_dir}: "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
        )
    )
    if steps:
        print(f"plots in {args.run_dir / 'report'}")
    page = write_completions_report(args.run_dir, args.run_dir / "report")
    if page is not None:
        print(f"completions at the first, middle and last logged steps: {page}")
    return 0


def _run_ladder_and_budget(run: Path) -> tuple[tuple[int, ...], float | None]:
    """(``controller.candidates``, ``controller.delta``) of the config saved with the
    newest checkpoint of ``run``, read without verifying or moving anything (the run may still
    be training); ((), None) when there is no checkpoint or its config no longer loads."""
    if not (run / "checkpoints").is_dir():
        return (), None
    from sagc_jax.train.safety.checkpoint import CheckpointStore

    store = CheckpointStore(run / "checkpoints", async_save=False)
    try:
        step = store.latest_step()
        if step is None:
            return (), None
        controller = from_dict(store.read_meta(step)["config"]).controller
    except (ConfigError, OSError, KeyError, ValueError):  # unreadable, or keys since removed
        return (), None
    finally:
        store.close()
    return controller.candidates, controller.delta
