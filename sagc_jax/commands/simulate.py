"""``sagc-jax simulate`` and ``sagc-jax replay``: the controllers of sim.controllers compared on
a synthetic rollout-length workload, or on the lengths a real run logged (``sagc_jax.sim``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from sagc_jax.commands.common import (
    UserError,
    add_config_args,
    add_timing_args,
    load_config,
    run_dir,
    timing_overrides,
)
from sagc_jax.config import Config, to_dict


def add_parser(subparsers) -> None:
    """Both commands: simulate, then replay."""
    p = subparsers.add_parser(
        "simulate",
        help="compare controllers on a synthetic rollout-length workload (no accelerator)",
        description="Run every controller of sim.controllers over the workload of the sim "
        "section; print a table and write CSV files and PNG plots into the run directory.",
    )
    add_config_args(p)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also run seeds 0..N-1 and print mean +- std and differences paired against sagc",
    )
    add_timing_args(p)
    p.set_defaults(func=cmd_simulate)

    p = subparsers.add_parser(
        "replay",
        help="compare controllers on lengths logged by a real run (JSONL)",
        description="Like simulate, but the lengths come from a JSONL log with one object per "
        "step holding 'lengths': [[int, ...], ...] (one list per group).",
    )
    add_config_args(p)
    p.add_argument("--log", type=Path, required=True, help="JSONL file of per-step lengths")
    add_timing_args(p)
    p.set_defaults(func=cmd_replay)


def cmd_simulate(args: argparse.Namespace) -> int:
    from sagc_jax.sim import SyntheticWorkload

    timer = _compare_and_report(args, lambda cfg: SyntheticWorkload(cfg.sim), "simulate")
    if args.seeds > 1:
        from sagc_jax.sim.seeds import format_seed_table, run_seeds

        cfg = load_config(args.config, timing_overrides(args))
        print(
            f"over {args.seeds} seeds (sim.seed and controller.sagc/hybrid.seed + "
            f"0..{args.seeds - 1}, mean +- std; the last two columns paired against sagc):"
        )
        print(format_seed_table(run_seeds(cfg, args.seeds, timer), timer.label))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from sagc_jax.sim import ReplayWorkload

    def workload(cfg: Config):
        try:
            return ReplayWorkload(
                args.log, seed=cfg.sim.seed, default_prompt_tokens=cfg.sim.prompt_tokens
            )
        except ValueError as err:
            raise UserError(str(err)) from None

    _compare_and_report(args, workload, "replay")
    return 0


def _compare_and_report(args, workload_factory, command: str):
    """Play sim.controllers over the workload, print and write the table; returns the
    ``StepTimer`` that timed the steps."""
    from sagc_jax.planning.timing import step_timer
    from sagc_jax.sim import compare
    from sagc_jax.sim.report import format_table, summary_rows, write_csv, write_plots

    cfg = load_config(args.config, timing_overrides(args))
    workload = workload_factory(cfg)
    # the sampler's cap: the synthetic workload's, or the logged run's (sampling section)
    cap = cfg.sim.max_new_tokens if command == "simulate" else cfg.sampling.max_new_tokens
    timer = step_timer(cfg, cfg.sim.prompt_tokens + cfg.sim.max_new_tokens, max_new_tokens=cap)
    runs = compare(cfg, workload, timer)
    rows = summary_rows(runs)
    table = format_table(rows, timer.label, bootstrapped=command == "replay")
    out_dir = run_dir(cfg, args.config, command)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (out_dir / "table.md").write_text(table + "\n")
    written = write_csv(runs, rows, out_dir)
    if cfg.logging.plots:
        written += write_plots(runs, out_dir, cfg.controller.delta)
    c = cfg.controller
    print(
        f"{command}: {workload.num_steps} steps, tau={c.tau}, delta={c.delta}, "
        f"scope={c.scope}, candidates={list(c.candidates)}"
    )
    print(table)
    print(f"wrote {len(written)} files to {out_dir}")
    return timer
