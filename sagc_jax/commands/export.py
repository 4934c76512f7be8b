"""``sagc-jax export``: a run's newest checkpoint as a Hugging Face model directory
(``sagc_jax.export``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="a run's newest checkpoint as a Hugging Face model directory (LoRA: merged, and "
        "the adapters in PEFT's layout)",
        description="Writes OUT_DIR/config.json and model.safetensors (a LoRA run's adapters "
        "merged into the weights) and the run's tokenizer files; for a LoRA run also "
        "OUT_DIR/adapter/ (adapter_config.json, adapter_model.safetensors) for "
        "peft.PeftModel.from_pretrained over its base: model.hf_checkpoint, or else the base "
        "written to OUT_DIR/base/. Everything is written into OUT_DIR.export-tmp and renamed "
        "to OUT_DIR at the end: an export is whole or absent.",
    )
    p.add_argument("run_dir", type=Path, help="a sagc-jax train (or sft) run directory")
    p.add_argument("out_dir", type=Path, help="a new (or empty) directory to write")
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="LoRA run over model.hf_checkpoint: only the PEFT adapters, into OUT_DIR",
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="export the newest checkpoint of a run that has not reached its last step",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from sagc_jax.export import export_run

    export_run(
        args.run_dir, args.out_dir, adapters_only=args.adapters_only, unfinished_ok=args.unfinished
    )
    return 0
