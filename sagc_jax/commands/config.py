"""``sagc-jax config``: the resolved configuration as YAML, or (``--reference``) every key with
its default and meaning, the text of docs/config.md."""

from __future__ import annotations

import argparse

import yaml

from sagc_jax.commands.common import add_config_args, load_config
from sagc_jax.config import to_dict


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("config", help="print the resolved configuration as YAML")
    add_config_args(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="print every key with its default, what it accepts and its meaning (Markdown: "
        "docs/config.md) instead",
    )
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        from sagc_jax.planning.choices import reference_markdown

        print(reference_markdown(), end="")
        return 0
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0
