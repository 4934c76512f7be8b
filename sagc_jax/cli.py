"""The ``sagc-jax`` command line: ``config``, ``simulate`` and ``replay``.

Every subcommand takes ``--config FILE`` and any number of ``--set section.key=value``.
Bad input (config, paths, logs) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from sagc_jax.config import Config, ConfigError, load_config, to_dict

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def _add_common(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument("--config", type=Path, required=config_required, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set controller.sagc.delta=0.2",
    )


def _run_dir(cfg: Config, config_path: Path | None, command: str) -> Path:
    if cfg.logging.run_dir:
        path = Path(cfg.logging.run_dir)
    else:
        stem = config_path.stem if config_path else "defaults"
        path = Path("runs") / f"{command}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{path}: cannot create the run directory ({err.strerror})") from None
    return path


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _compare_and_report(args, workload_factory, command: str) -> int:
    from sagc_jax.sim import compare
    from sagc_jax.sim.report import format_table, summary_rows, write_csv, write_plots

    cfg = load_config(args.config, args.overrides)
    workload = workload_factory(cfg)
    runs = compare(cfg, workload)
    rows = summary_rows(runs)
    table = format_table(rows, bootstrapped=command == "replay")
    out_dir = _run_dir(cfg, args.config, command)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (out_dir / "table.md").write_text(table + "\n")
    written = write_csv(runs, rows, out_dir)
    if cfg.logging.plots:
        written += write_plots(runs, out_dir, cfg.controller.sagc.delta)
    sagc = cfg.controller.sagc
    print(
        f"{command}: {workload.num_steps} steps, tau={sagc.tau}, delta={sagc.delta}, "
        f"scope={sagc.scope}, candidates={list(sagc.candidates)}"
    )
    print(table)
    print(f"wrote {len(written)} files to {out_dir}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from sagc_jax.sim import SyntheticWorkload

    return _compare_and_report(args, lambda cfg: SyntheticWorkload(cfg.sim), "simulate")


def cmd_replay(args: argparse.Namespace) -> int:
    from sagc_jax.sim import ReplayWorkload

    def workload(cfg: Config):
        try:
            return ReplayWorkload(
                args.log, seed=cfg.sim.seed, default_prompt_tokens=cfg.sim.prompt_tokens
            )
        except ValueError as err:
            raise UserError(str(err)) from None

    return _compare_and_report(args, workload, "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagc-jax",
        description="JAX-native GRPO/DAPO trainer with Straggler-Aware Group Control.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved configuration as YAML")
    _add_common(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "simulate",
        help="compare controllers on a synthetic rollout-length workload (no accelerator)",
        description="Run every controller of sim.controllers over the workload of the sim "
        "section; print a table and write CSV files and PNG plots into the run directory.",
    )
    _add_common(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "replay",
        help="compare controllers on lengths logged by a real run (JSONL)",
        description="Like simulate, but the lengths come from a JSONL log with one object per "
        "step holding 'lengths': [[int, ...], ...] (one list per group).",
    )
    _add_common(p)
    p.add_argument("--log", type=Path, required=True, help="JSONL file of per-step lengths")
    p.set_defaults(func=cmd_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, UserError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
