"""``sagc-jax eval``: held-out accuracy and mean completion length of a run's saved policy."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import UserError, add_config_args
from sagc_jax.config import (
    ConfigError,
    changed_keys,
    config_differences,
    config_over_saved,
    from_dict,
    load_config,
    to_dict,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="held-out accuracy and mean completion length of a run",
        description="Evaluates with the config saved in the run's checkpoint (plus any --set); "
        "--config FILE replaces it, and the keys that differ from the saved one are listed.",
    )
    add_config_args(p)
    p.add_argument("--checkpoint", type=Path, required=True, help="run directory to evaluate")
    p.add_argument("--num", type=int, default=None, help="held-out prompts (train.eval_size)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from flax import nnx

    from sagc_jax.export import merged_run_params
    from sagc_jax.tasks.source import make_source
    from sagc_jax.train.evaluate import evaluate_policy, policy_sampler
    from sagc_jax.train.policy import build_model, build_tokenizer, load_run_params
    from sagc_jax.train.safety.faults import phase

    run = args.checkpoint
    saved, step = _saved_run_config(run)
    if args.config is None:  # the run's own config, with the --set overrides
        cfg = config_over_saved(saved, args.overrides, str(run))
        used = f"the config saved with the run (step {step})"
        if args.overrides:
            used += " with " + " ".join(f"--set {o}" for o in args.overrides)
        print(f"eval {run}: {used}")
    else:
        cfg = load_config(args.config, args.overrides)
        differ = [
            k for k in config_differences(saved, to_dict(cfg)) if not k.startswith("logging.")
        ]
        blocking = changed_keys(saved, cfg, "params")
        if blocking:
            raise UserError(
                f"{run}: its parameters do not fit --config {args.config}, which differs from "
                f"the run's saved config in {', '.join(blocking)}; leave out --config to use "
                f"the run's own"
            )
        listed = ", ".join(differ[:8]) + ("..." if len(differ) > 8 else "")
        print(
            f"eval {run}: config {args.config}"
            + (f"; differs from the run's saved config in {listed}" if differ else "")
        )
    tokenizer = build_tokenizer(cfg) if cfg.data.task != "synthetic" else None
    source = make_source(cfg, tokenizer)
    model = build_model(cfg, source.tokenizer, seed=0)
    graphdef, params = nnx.split(model)
    if cfg.model.lora_rank:  # the adapters merged into their base: the plain model's weights
        params = merged_run_params(run, source.tokenizer)
    else:
        params = load_run_params(run, params, unfinished_ok=True)
    sampler = policy_sampler(graphdef, model.config, source.tokenizer, sampling=cfg.sampling)
    with phase("the evaluation"):
        result = evaluate_policy(sampler, params, source, cfg, args.num)
    print(f"eval {run}: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return 0


def _saved_run_config(run: Path) -> tuple[dict, int]:
    """(the config saved with the newest verified checkpoint of ``run``, its step)."""
    from sagc_jax.train.safety.checkpoint import newest_verified_meta

    if not (run / "checkpoints").is_dir():
        raise UserError(f"{run}: no checkpoints/ directory; --checkpoint takes a run directory")
    step, meta = newest_verified_meta(run / "checkpoints")
    if step is None:
        raise UserError(f"{run / 'checkpoints'}: no complete checkpoint to evaluate")
    try:
        return to_dict(from_dict(meta["config"])), step  # keys added since get defaults
    except ConfigError as err:
        raise UserError(f"{run}: its saved config no longer loads ({err}); pass --config") from None
