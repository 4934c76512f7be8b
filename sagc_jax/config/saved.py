"""A run's saved config against the one it is resumed or warm-started with: which keys differ,
and which of them the run may not change."""

from __future__ import annotations

import copy
import dataclasses
import typing

from sagc_jax.config.base import ConfigError
from sagc_jax.config.load import from_dict, parse_override, set_dotted, to_dict
from sagc_jax.config.sections import Config


def config_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two ``to_dict`` trees."""
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += config_differences(a, b, f"{prefix}{k}.")
        elif a != b:
            keys.append(f"{prefix}{k}")
    return keys


def key_flag(key: str, flag: str) -> bool:
    """The ``option`` flag (resumable, warm_start, params) of a dotted key. A key the config no
    longer has (removed or renamed since a run was saved) takes its section's default (False
    when the section is gone too)."""
    cls, parts = Config, key.split(".")
    for i, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        if name not in fields:
            return bool(getattr(cls, f"_{flag}", False))
        if i == len(parts) - 1 or not dataclasses.is_dataclass(hints[name]):
            value = fields[name].metadata.get(flag)
            return bool(getattr(cls, f"_{flag}", False) if value is None else value)
        cls = hints[name]
    return False


def changed_keys(saved: dict, cfg: Config, which: str) -> list[str]:
    """Keys whose values differ between a saved ``to_dict`` config (keys added since take
    their defaults) and ``cfg``, among those ``which`` names:

    "unresumable": a resumed ``train`` run may not change them (``option(resumable=False)``);
    "warm_start": they shape the ``sft`` warm start (``option(warm_start=True)``);
    "params": they shape the stored parameters (``option(params=True)``).
    """
    try:
        saved = to_dict(from_dict(saved))
    except ConfigError:
        pass  # a key since removed or renamed: compared as saved
    differ = config_differences(saved, to_dict(cfg))
    if which == "unresumable":
        return [k for k in differ if not key_flag(k, "resumable")]
    if which in ("warm_start", "params"):
        return [k for k in differ if key_flag(k, which)]
    raise ValueError(f"which = {which!r}; allowed: unresumable, warm_start, params")


def config_over_saved(saved: dict, overrides: typing.Sequence[str], where: str) -> Config:
    """A run's saved ``to_dict`` config with ``--set`` overrides on top (``where`` names the
    run in errors)."""
    data = copy.deepcopy(saved)
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value, f"--set {text}")
    try:
        return from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"--set over the config saved in {where}: {err}") from None
