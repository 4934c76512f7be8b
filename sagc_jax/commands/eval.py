"""``sagc-jax eval``: held-out accuracy and mean completion length of a run's saved policy, or of
a Hugging Face model directory (a base model before training) on any task."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from sagc_jax.commands.common import UserError, add_config_args, load_config
from sagc_jax.config import (
    ConfigError,
    changed_keys,
    config_differences,
    config_over_saved,
    from_dict,
    to_dict,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="held-out accuracy and mean completion length of a run or a Hugging Face model",
        description="A run directory is evaluated with the config saved in its checkpoint (plus "
        "any --set); --config FILE replaces it, and the keys that differ from the saved one are "
        "listed. A Hugging Face model directory (config.json and safetensors: a base model) is "
        "evaluated with --config/--set as model.hf_checkpoint, on the task they give. Greedy by "
        "default; --samples K draws K completions per prompt at sampling.temperature and adds "
        "pass@k. The completions decode through as many rows at once as a training step of the "
        "largest G (sampling.slots), the rest streaming through them.",
    )
    add_config_args(p)
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="run directory, or Hugging Face model directory, to evaluate",
    )
    p.add_argument("--num", type=int, default=None, help="held-out prompts (train.eval_size)")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="completions per prompt: 1 = greedy (default); K > 1 = sampled, with pass@k",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON")
    p.add_argument(
        "--completions",
        type=Path,
        default=None,
        help="write every completion (prompt, sample, length, reward, truncated, and its texts: "
        "prompt_text, completion_text, answer, accepted; capped at logging.completions_chars) "
        "to this JSONL, a histogram of their lengths beside it (.png), and print the length "
        "tail: the share at "
        "the cap and, per G of controller.candidates up to --samples, the share of groups "
        "straggling (longest over controller.tau x median), without signal (rewards all equal) "
        "and the tokens a synchronous step decodes over the real ones",
    )
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from flax import nnx

    from sagc_jax.export import merged_run_params
    from sagc_jax.programs.compile_cache import use_compilation_cache
    from sagc_jax.programs.policy import build_model, source_tokenizer
    from sagc_jax.sampling.sampler import policy_sampler
    from sagc_jax.tasks.source import make_source
    from sagc_jax.train.evaluate import eval_metrics, heldout_completions
    from sagc_jax.train.safety.faults import phase
    from sagc_jax.train.warm_start import load_run_params

    if args.samples < 1:
        raise UserError(f"--samples = {args.samples}; allowed: 1 (greedy) or more (sampled)")
    path = args.checkpoint
    model_dir = _is_model_dir(path)
    if model_dir:
        cfg = load_config(args.config, [*args.overrides, f"model.hf_checkpoint={path}"])
        if cfg.model.lora_rank:
            raise UserError(f"{path}: a model directory is evaluated whole; unset model.lora_rank")
        print(f"eval {path}: a Hugging Face model, config {args.config or 'defaults'}")
        step = 0
    else:
        cfg, step = _run_config(path, args)
    use_compilation_cache(cfg.train.compilation_cache_dir, report=lambda x: print(f"eval: {x}"))
    tokenizer = source_tokenizer(cfg)
    source = make_source(cfg, tokenizer)
    model = build_model(cfg.model, source.tokenizer, seed=0)
    graphdef, params = nnx.split(model)
    if not model_dir:  # a model directory's weights are the ones build_model loaded
        if cfg.model.lora_rank:  # the adapters merged into their base: the plain model's
            params = merged_run_params(path, source.tokenizer)
        else:
            params = load_run_params(path, params, unfinished_ok=True)
    sampler = policy_sampler(
        graphdef,
        model.config,
        source.tokenizer,
        sampling=cfg.sampling,
        slots=_eval_slots(cfg, source),
    )
    with phase("the evaluation"):
        completions = heldout_completions(sampler, params, source, cfg, args.num, args.samples)
    result = eval_metrics(completions)
    print(f"eval {path}: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    if args.completions is not None:
        result.update(_write_tail(args.completions, completions, cfg, path))
    if args.out is not None:
        s = cfg.sampling
        record = {
            "checkpoint": str(path),
            "kind": "model" if model_dir else "run",
            "step": step,
            "task": cfg.data.task,
            "prompts": len(source.heldout(args.num or cfg.train.eval_size)),
            "samples": args.samples,
            "temperature": 0.0 if args.samples == 1 else s.temperature,
            "max_new_tokens": s.max_new_tokens,
            **result,
        }
        _write_json(args.out, record)
        print(f"eval {path}: wrote {args.out}")
    return 0


def _write_tail(out: Path, completions, cfg, path: Path) -> dict:
    """Write ``completions`` to ``out`` (JSONL) and their length histogram beside it, print the
    length tail; the tail's figures, keys prefixed ``tail/``."""
    from sagc_jax.analysis.tail import tail_summary, write_completions

    c = cfg.controller
    tail = tail_summary(
        completions.lengths_pk,
        completions.rewards_pk,
        completions.max_new_tokens,
        groups=c.candidates,
        tau=c.tau,
    )
    try:
        plot = write_completions(out, completions, tail, cfg.logging.completions_chars)
    except OSError as err:
        raise UserError(f"{out}: cannot write the completions ({err.strerror})") from None
    print(
        f"eval {path}: length tail: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in tail.items())
    )
    print(f"eval {path}: wrote {out} and {plot}")
    return {f"tail/{k}": v for k, v in tail.items()}


def _eval_slots(cfg, source) -> int:
    """Rows decoding at once: as many as a step of the run's largest G decodes (``sampling.slots``;
    ``auto``: the run resolved as the trainer resolves it, on the one device eval decodes on),
    so that K samples of every held-out prompt stream through no larger a KV cache than
    training held."""
    from sagc_jax.config import MeshConfig
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.planning.resolve import device_memory, resolve_run

    one_device = ShardingPlan.abstract(MeshConfig(), 1)  # eval decodes unsharded
    return resolve_run(cfg, one_device, source=source, device_bytes=device_memory()[0]).eval_slots


def _is_model_dir(path: Path) -> bool:
    """A Hugging Face model directory (config.json, no checkpoints/), or a run directory;
    UserError for neither."""
    if (path / "checkpoints").is_dir():
        return False
    if (path / "config.json").is_file():
        return True
    raise UserError(
        f"{path}: neither a run directory (no checkpoints/) nor a Hugging Face model directory "
        f"(no config.json); --checkpoint takes one of the two"
    )


def _write_json(path: Path, record: dict) -> None:
    """``record`` as JSON at ``path``, whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"{path}: cannot write the figures ({err.strerror})") from None


def _run_config(run: Path, args: argparse.Namespace):
    """(the config to evaluate run directory ``run`` with, its checkpoint's step)."""
    saved, step = _saved_run_config(run)
    if args.config is None:  # the run's own config, with the --set overrides
        cfg = config_over_saved(saved, args.overrides, str(run))
        used = f"the config saved with the run (step {step})"
        if args.overrides:
            used += " with " + " ".join(f"--set {o}" for o in args.overrides)
        print(f"eval {run}: {used}")
        return cfg, step
    cfg = load_config(args.config, args.overrides)
    differ = [k for k in config_differences(saved, to_dict(cfg)) if not k.startswith("logging.")]
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
    return cfg, step


def _saved_run_config(run: Path) -> tuple[dict, int]:
    """(the config saved with the newest verified checkpoint of ``run``, its step)."""
    from sagc_jax.train.safety.checkpoint import newest_verified_meta

    step, meta = newest_verified_meta(run / "checkpoints")
    if step is None:
        raise UserError(f"{run / 'checkpoints'}: no complete checkpoint to evaluate")
    try:
        return to_dict(from_dict(meta["config"])), step  # keys added since get defaults
    except ConfigError as err:
        raise UserError(f"{run}: its saved config no longer loads ({err}); pass --config") from None
