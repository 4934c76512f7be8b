"""What several subcommands share: the ``--config``/``--set`` flags, the modeled-time flags, the
run directory, the summary line, and the errors that mean bad input."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from sagc_jax import config
from sagc_jax.config import Config, ConfigError


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def add_config_args(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument("--config", type=Path, required=config_required, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set controller.delta=0.2",
    )


def load_config(path: Path | None, overrides: list[str]) -> Config:
    """The config of ``--config`` and ``--set``, its kinds checked against their tables
    (``planning.choices``): every error one line naming the file line or the ``--set``."""
    from sagc_jax.planning.choices import check_names

    return config.load_config(path, overrides, check=check_names)


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    """--hardware / --devices / --as-model: shorthands for sim.hardware, sim.devices and
    sim.model, the step-time model that re-times the lengths (``sim.steptime``)."""
    group = parser.add_argument_group("modeled time (the sim section's step-time model)")
    group.add_argument(
        "--hardware",
        help="sim.hardware: h100, h200, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, or custom "
        "(the illustrative constants)",
    )
    group.add_argument("--devices", type=int, help="sim.devices: chips of that accelerator")
    group.add_argument(
        "--as-model",
        metavar="MODEL",
        help="sim.model: time the lengths as this model's (a preset or an HF checkpoint)",
    )


def timing_overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides of ``add_timing_args``'s flags, after the user's own --set."""
    flags = (("hardware", args.hardware), ("devices", args.devices), ("model", args.as_model))
    return args.overrides + [f"sim.{key}={value}" for key, value in flags if value is not None]


def run_dir(cfg: Config, config_path: Path | None, command: str) -> Path:
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


def print_summary(title: str, summary: dict, out_dir: Path) -> None:
    plain = {
        k: v
        for k, v in summary.items()
        if (isinstance(v, int | str) and v != "") or (isinstance(v, float) and math.isfinite(v))
    }
    _write_whole(out_dir / "summary.json", json.dumps(plain, indent=2, allow_nan=False) + "\n")
    print(
        f"{title}: "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in plain.items()
        )
    )


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` through a sibling renamed over it: whole or (a full disk: one line, the
    sibling removed) not at all."""
    from sagc_jax.train.metrics import full_disk_error

    partial = path.with_name(path.name + ".tmp")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        line = full_disk_error(err, path, f"while writing {path.name}: it was not written")
        if line is None:
            raise
        raise line from None


def bad_input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad user input (a sentence, not a traceback)."""
    from sagc_jax.tasks import DatasetError, RewardError

    errors: tuple[type[Exception], ...] = (ConfigError, UserError, DatasetError, RewardError)
    if "sagc_jax.train.safety.checkpoint" in sys.modules:  # only loaded by commands that read runs
        from sagc_jax.train.safety.checkpoint import CheckpointError

        errors += (CheckpointError,)
    if "sagc_jax.train.safety.runlock" in sys.modules:  # sft locks its run before loading that
        from sagc_jax.train.safety.runlock import RunDirError

        errors += (RunDirError,)
    if "sagc_jax.models" in sys.modules:  # only loaded by commands that build a model
        from sagc_jax.models import CheckpointMismatchError

        errors += (CheckpointMismatchError,)
    return errors
