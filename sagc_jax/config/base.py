"""What every config section is built from: :func:`option` fields that carry their bounds,
the :class:`Section` mixin that checks them on construction, and :class:`ConfigError`.

Every module of the package imports this one, which imports none of them, nor numpy or jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ConfigError", "Section", "describe_bounds", "option"]


class ConfigError(ValueError):
    """A configuration value is unknown, mis-typed or out of range (message is one line)."""


def option(
    default: Any,
    *,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    choices=None,
    named: bool = False,
    help: str = "",
    resumable: bool | None = None,
    warm_start: bool | None = None,
    params: bool = False,
    outcome: bool | None = None,
):
    """A dataclass field with a default, bounds and allowed choices, checked on construction.

    named: it names a kind of an extension point, whose table (``config.choices.Registry``)
    lives with the kinds, above this package: its names are checked at resolution
    (``config.choices.check_names``) and docs/config.md lists them and their help from there.

    What a change of the key means for saved work (:func:`changed_keys`):
    resumable: a resumed ``train`` run may change it (None: the section's ``_resumable``);
    warm_start: it shapes the ``sft`` warm start, so a changed value is neither reused nor
    resumed (None: the section's ``_warm_start``);
    params: it shapes the stored parameters (a config differing in it cannot load a run's);
    outcome: it can change what a run computes (anything its metrics hold but the timings), so a
    study's record made under another value is refused (None: the section's ``_outcome``);
    where files go, what is logged, how often checkpoints are written and how programs are
    compiled do not.
    """
    if isinstance(default, list | dict):
        raise TypeError("use tuples for sequence defaults: configs are frozen")
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "help": help}
    meta["named"] = named
    meta.update(resumable=resumable, warm_start=warm_start, params=params, outcome=outcome)
    return dataclasses.field(default=default, metadata=meta)


def describe_bounds(meta: dict) -> str:
    parts = []
    for key, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if meta.get(key) is not None:
            parts.append(f"{sym} {meta[key]}")
    return " and ".join(parts)


def _check_scalar(key: str, value: Any, meta: dict) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        ok = (
            (meta.get("ge") is None or value >= meta["ge"])
            and (meta.get("gt") is None or value > meta["gt"])
            and (meta.get("le") is None or value <= meta["le"])
            and (meta.get("lt") is None or value < meta["lt"])
        )
        if not ok:
            raise ConfigError(
                f"{key} = {value!r} is out of range; allowed: {describe_bounds(meta)}"
            )


def _validate_fields(obj: Any, prefix: str) -> None:
    """Check every field of a config dataclass against its ``option`` metadata."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if isinstance(value, tuple):
            for item in value:
                _check_scalar(key, item, f.metadata)
        elif value is not None:
            _check_scalar(key, value, f.metadata)


class Section:
    """Mixin: validates option bounds on construction; subclasses add cross-field rules."""

    _prefix = ""
    _resumable = False  # the default of its options' ``resumable``
    _warm_start = False  # the default of its options' ``warm_start``
    _outcome = True  # the default of its options' ``outcome``

    def __post_init__(self) -> None:
        _validate_fields(self, self._prefix)
        self.check()

    def check(self) -> None:
        """Cross-field rules; raise ConfigError."""
