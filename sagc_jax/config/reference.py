"""docs/config.md, generated from the config dataclasses (``sagc-jax config --reference``)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import yaml

from sagc_jax.config.base import describe_bounds
from sagc_jax.config.load import type_name
from sagc_jax.config.saved import key_flag
from sagc_jax.config.sections import Config


def reference_markdown(tables: Mapping) -> str:
    """docs/config.md: every key with its default, what it accepts and its help, one table per
    section, generated from the dataclasses (``sagc-jax config --reference``); a key that names
    a kind lists the names and their help from its table in ``tables`` (by key:
    ``planning.choices.TABLES``)."""
    out = [
        "# Configuration reference",
        "",
        "Every key of a run's config, generated from the config dataclasses "
        "(`sagc_jax/config/sections.py`, the `sim` section `sagc_jax/config/sim.py`) by "
        "`sagc-jax config --reference > docs/config.md`; a test "
        "checks that this page is current. A config file is a YAML mapping of these sections; "
        "every key is optional, and `--set section.key=value` overrides one on the command "
        "line. A resumed run must keep the saved config but for the keys marked *(a resume may "
        "change it)*. [Back to the README](../README.md)",
    ]

    def section(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        nested, rows = [], []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                nested.append((hints[f.name], f"{prefix}{f.name}."))
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meta = f.metadata
            table = tables[f"{prefix}{f.name}"] if meta.get("named") else None
            choices = table.names() if table is not None else meta.get("choices")
            accepts = " or ".join(f"`{c}`" for c in choices) if choices else ""
            if table is not None and getattr(table, "form", None):
                accepts += f" or `{table.form[0]}`"
            if accepts and isinstance(default, tuple):
                accepts = f"a list, each {accepts}"
            accepts = accepts or type_name(hints[f.name])
            if bounds := describe_bounds(meta):
                accepts += f", {bounds}"
            value = list(default) if isinstance(default, tuple) else default
            shown = yaml.safe_dump(value, default_flow_style=True, width=1000)
            shown = shown.removesuffix("\n...\n").strip()
            meaning = "; ".join(p for p in (meta.get("help", ""), table and table.help()) if p)
            meaning = " ".join(meaning.split()).replace("|", "\\|")
            if key_flag(f"{prefix}{f.name}", "resumable"):
                meaning += " *(a resume may change it)*"
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {accepts} | {meaning} |")
        if rows:
            doc = " ".join((cls.__doc__ or "").split())
            out.extend(["", f"## `{prefix.rstrip('.')}`", "", doc, ""])
            out.extend(["| key | default | accepts | meaning |", "| --- | --- | --- | --- |"])
            out.extend(rows)
        for child, child_prefix in nested:
            section(child, child_prefix)

    section(Config, "")
    return "\n".join(out) + "\n"
