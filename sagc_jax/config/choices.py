"""The table of an extension point (:class:`Registry`): one entry per kind, by the name a config
key takes, and the check of a config's names against the tables (:func:`check_names`).

The tables live where their kinds are defined, above this package: ``controller.registry``'s
``CONTROLLERS`` (``controller.kind``, the specs of ``sim.controllers`` and ``compare``),
``tasks.source``'s ``SOURCES`` (``data.task``), ``tasks.rewards``'s ``REWARDS`` (``data.reward``)
and ``rl.losses``' ``ALGORITHMS`` (``loss.algorithm``). ``config/`` is the bottom layer and
imports none of them (``tests/test_layers.py``), so a key that names a kind declares it
(``option(..., named=True)``) and holds no list of its own; its names are checked against the
tables once they are known, at resolution: ``planning.choices.check_names`` hands them to
:func:`check_names`, from ``load_config`` (``check=``, every command's config, errors naming the
file line or ``--set`` as before) and from ``planning.resolve.resolve_run``. docs/config.md
takes its lists and help from the same tables (``reference_markdown``). A new kind is its module
and its entry: no list in the config, the docs or the tests to extend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sagc_jax.config.base import ConfigError

__all__ = ["Registry", "check_names"]


class Registry(dict):
    """The kinds of one extension point, ``name -> entry``, in the order the docs list them;
    every entry has ``help``, the line docs/config.md says of the kind.

    ``key``: the config key that names one (``controller.kind``), or a description where none
    does (a loss aggregation). ``also``: words the key takes besides the kinds (``auto``);
    ``form``: a free form it takes too, ``(what, test)`` (``('package.module:function',
    is_import_path)``).
    """

    def __init__(
        self,
        key: str,
        entries: Iterable[tuple[str, Any]] = (),
        *,
        also: tuple[str, ...] = (),
        form: tuple[str, Callable[[str], bool]] | None = None,
    ) -> None:
        super().__init__(entries)
        self.key, self.also, self.form = key, also, form

    def names(self) -> list[str]:
        """Every word the key takes: ``also`` first, then the kinds."""
        return [*self.also, *self]

    def help(self) -> str:
        """``'name: its help; ...'`` over the kinds, for the key's help text."""
        return "; ".join(f"{name}: {entry.help}" for name, entry in self.items())

    def check(self, value: str) -> None:
        """ConfigError naming the allowed names unless ``value`` is one (or fits ``form``)."""
        if value in self.also or value in self:
            return
        if self.form is not None and self.form[1](value):
            return
        tail = f" or '{self.form[0]}'" if self.form else ""
        raise ConfigError(
            f"{self.key} = {value!r} is not allowed; choose one of {self.names()}{tail}"
        )


def check_names(cfg: Any, tables: Mapping[str, Registry]) -> None:
    """Every key of ``cfg`` declared ``named`` checked against its table in ``tables`` (by key):
    a ConfigError naming the key, the value and the names allowed."""
    for key, value in named_values(cfg):
        if key not in tables:
            raise KeyError(f"{key} is named but no table of its kinds was given")
        for one in value if isinstance(value, tuple) else (value,):
            tables[key].check(one)


def named_values(section: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(key, value)`` of every ``named`` option of a section and its subsections."""
    found = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            found += named_values(value, f"{prefix}{f.name}.")
        elif f.metadata.get("named"):
            found.append((f"{prefix}{f.name}", value))
    return found
