"""``sagc-jax simulate`` and ``sagc-jax replay``: the controllers of sim.controllers compared on
a synthetic rollout-length workload, or on the lengths a real run logged (``sagc_jax.sim``); and
``replay --records``: the adaptive controllers under the paper's straggle test and the
cost-aware ones, over a study's recorded traces (``analysis.straggle_replay``)."""

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
        "step holding 'lengths': [[int, ...], ...] (one list per group; optional 'rewards' "
        "shaped alike, 'prompt_ids', 'prompt_tokens'). With --records instead: the traces of "
        "a study's widest fixed arm (`compare --records`), replayed by SAGC, SAGC+ and "
        "sagc_value under the paper's straggle test and the two cost-aware tests "
        "(docs/experiments/real-straggler.md); no config needed, the records hold it.",
    )
    add_config_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--log", type=Path, help="JSONL file of per-step lengths")
    source.add_argument(
        "--records", type=Path, metavar="DIR", help="a study's folder of run records"
    )
    p.add_argument(
        "--arm",
        metavar="SPEC",
        help="with --records: the arm whose traces are replayed (default: the widest fixed G)",
    )
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

    if args.records is not None:
        return _replay_records(args)
    if args.arm is not None:
        raise UserError("--arm reads --records; a --log is one run's trace")

    def workload(cfg: Config):
        try:
            return ReplayWorkload.from_file(
                args.log, seed=cfg.sim.seed, default_prompt_tokens=cfg.sim.prompt_tokens
            )
        except ValueError as err:
            raise UserError(str(err)) from None

    _compare_and_report(args, workload, "replay")
    return 0


def _replay_records(args: argparse.Namespace) -> int:
    """``replay --records``: the straggle tests over a study's traces (the records' config)."""
    from sagc_jax.analysis.records import RecordError
    from sagc_jax.analysis.straggle_replay import format_replay, replay_study

    if args.config is not None or args.overrides:
        raise UserError("--records replays under the records' own config; drop --config/--set")
    try:
        flags = (("hardware", args.hardware), ("devices", args.devices), ("model", args.as_model))
        sim = {key: value for key, value in flags if value is not None}
        result = replay_study(args.records, args.arm, sim)
    except RecordError as err:
        raise UserError(str(err)) from None
    print(format_replay(result))
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
