"""``sagc-jax compare``: train under several controllers side by side and tabulate the results
(``sagc_jax.analysis.compare``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import (
    UserError,
    add_config_args,
    add_timing_args,
    load_config,
    run_dir,
    timing_overrides,
)
from sagc_jax.controller import parse_controller_spec


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="train under several controllers side by side and tabulate the results",
        description="Runs the config once per controller and seed, one after the other (seed "
        "by seed, every controller in turn, so that a drift of the machine's speed falls on "
        "all alike), into one directory; writes compare.md, compare.csv and PNG plots.",
    )
    add_config_args(p, config_required=True)
    p.add_argument(
        "--controllers",
        default="fixed:4,fixed:8,fixed:16,sagc,sagc_plus",
        help="comma-separated controller specs (default: %(default)s)",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per controller")
    p.add_argument("--steps", type=int, default=None, help="step budget (default: train.steps)")
    add_timing_args(p)
    p.add_argument(
        "--also-hardware",
        default="",
        metavar="HW,...",
        help="comma-separated sim.hardware names: the modeled times also on each of these "
        "(compare.md gets a table per name), besides the sim section's own",
    )
    p.add_argument(
        "--records",
        type=Path,
        metavar="DIR",
        help="a folder of run records, meant to be committed (docs/training.md, Study "
        "records): each run that finishes writes DIR/<controller>-seed<k>.json (its metrics, "
        "evaluations, config, commit and host; no checkpoints), and a run recorded there is not "
        "run again",
    )
    p.add_argument(
        "--from-records",
        action="store_true",
        help="train nothing: rebuild the tables and plots from --records alone",
    )
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from sagc_jax.analysis.compare import compare, format_tables

    cfg = load_config(args.config, timing_overrides(args))
    controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
    for spec in controllers:
        parse_controller_spec(spec)
    if args.seeds < 1 or (args.steps is not None and args.steps < 1):
        raise UserError(f"--seeds {args.seeds} / --steps {args.steps}: both must be >= 1")
    also = tuple(h.strip() for h in args.also_hardware.split(",") if h.strip())
    for hw in also:  # an unknown name fails here, with the allowed ones, before any run
        load_config(args.config, [*timing_overrides(args), f"sim.hardware={hw}"])
    if args.from_records and args.records is None:
        raise UserError("--from-records: name the records' folder with --records DIR")
    if args.records is not None and args.records.exists() and not args.records.is_dir():
        raise UserError(f"--records {args.records}: not a folder")
    out_dir = run_dir(cfg, args.config, "compare")
    result = compare(
        cfg,
        controllers,
        args.seeds,
        args.steps,
        out_dir,
        cfg.logging.progress,
        also_hardware=also,
        records=args.records,
        from_records=args.from_records,
    )
    print(format_tables(result))
    print(f"wrote compare.md, compare.csv, runs.csv and plots to {out_dir}")
    return 0
