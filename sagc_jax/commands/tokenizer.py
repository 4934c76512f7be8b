"""``sagc-jax tokenizer``: a tokenizer directory trained on a dataset's text."""

from __future__ import annotations

import argparse
from pathlib import Path

from sagc_jax.commands.common import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenizer",
        help="build a tokenizer directory from a dataset's text (no Hugging Face model needed)",
        description="Trains a tokenizer on the prompts and answers of JSONL/Parquet files and "
        "writes tokenizer.json and tokenizer_config.json (pad/bos/eos tokens, a chat template) "
        "into --out, for model.tokenizer.",
    )
    p.add_argument(
        "--data", type=Path, nargs="+", required=True, metavar="FILE", help="dataset files"
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write")
    p.add_argument(
        "--kind",
        choices=("bpe", "char"),
        default="bpe",
        help="bpe: byte-level BPE trained on the text; char: one token per character "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        metavar="N",
        help="most tokens, specials included; at most the model's vocabulary (default: "
        "%(default)s, the tiny preset's)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing tokenizer in --out")
    p.set_defaults(func=cmd_tokenizer)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from sagc_jax.models.tokenizer import train_tokenizer
    from sagc_jax.tasks import load_dataset

    out = args.out
    if (out / "tokenizer.json").exists() and not args.force:
        raise UserError(f"{out / 'tokenizer.json'} exists; choose another --out or add --force")
    rows = [row for path in args.data for row in load_dataset(path)]
    texts = (text for row in rows for text in (row.prompt, row.answer))
    try:
        tok = train_tokenizer(texts, out, kind=args.kind, vocab_size=args.vocab_size)
    except ValueError as err:
        raise UserError(f"--kind {args.kind} --vocab-size {args.vocab_size}: {err}") from None
    except OSError as err:
        raise UserError(f"{out}: cannot write the tokenizer ({err.strerror})") from None
    print(
        f"tokenizer: wrote {out / 'tokenizer.json'} and tokenizer_config.json ({args.kind}, "
        f"{tok.vocab_size} tokens, from {len(rows)} rows); train with --set model.tokenizer={out}"
    )
    return 0
