"""``sagc-jax sft``: the supervised warm start on task traces."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import add_config_args, load_config, print_summary, run_dir
from sagc_jax.config import Config


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "sft",
        help="supervised warm start on task traces",
        description="Next-token training on reference traces of the synthetic task; writes "
        "Orbax checkpoints into the run directory (every sft.checkpoint_every steps, at a stop "
        "signal, at the end) for train.init_checkpoint. A finished run directory is reused and "
        "an unfinished one resumed when its config matches on the keys that shape the warm "
        "start (model, sft, data, sampling.max_new_tokens); otherwise it is refused.",
    )
    add_config_args(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="train again from scratch (the old checkpoints move to checkpoints.replaced/)",
    )
    p.set_defaults(func=cmd_sft)


def cmd_sft(args: argparse.Namespace) -> int:
    from sagc_jax.train.safety.runlock import RunLock

    cfg = load_config(args.config, args.overrides)
    out_dir = run_dir(cfg, args.config, "sft")
    with RunLock(out_dir, "sft", report=lambda line: print(f"sft: {line}")):
        return _sft_locked(args, cfg, out_dir)


def _sft_locked(args: argparse.Namespace, cfg: Config, out_dir: Path) -> int:
    from flax import nnx

    from sagc_jax.programs.compile_cache import use_compilation_cache
    from sagc_jax.programs.policy import build_model
    from sagc_jax.sampling.sampler import policy_sampler
    from sagc_jax.tasks.source import make_source
    from sagc_jax.train.evaluate import evaluate_policy
    from sagc_jax.train.safety.faults import phase, resume_hint
    from sagc_jax.train.sft import run_sft, set_aside, sft_progress

    if args.force:
        moved = set_aside(out_dir)
        if moved:
            print(f"sft: --force: {moved}; training from scratch")
    else:
        step, finished = sft_progress(cfg, out_dir)  # refuses a run of another config
        if finished and (out_dir / "summary.json").exists():
            print(f"sft: reusing the warm start in {out_dir} (--force to train it again)")
            return 0
        if step is not None:
            print(f"sft: resuming {out_dir} from step {step}")
    use_compilation_cache(cfg.train.compilation_cache_dir, report=lambda x: print(f"sft: {x}"))
    source = make_source(cfg)
    model = build_model(cfg.model, source.tokenizer, seed=cfg.sft.seed)
    graphdef, params = nnx.split(model)
    result = run_sft(cfg, (graphdef, params, source), out_dir, progress=cfg.logging.progress)
    sampler = policy_sampler(graphdef, model.config, source.tokenizer, sampling=cfg.sampling)
    kept = f"the finished warm start is saved in {out_dir}; {resume_hint(cfg, out_dir)}"
    with phase("the final evaluation", kept):
        result.update(evaluate_policy(sampler, result.pop("params"), source, cfg))
    print_summary(f"sft done, wrote {out_dir}", result, out_dir)
    return 0
