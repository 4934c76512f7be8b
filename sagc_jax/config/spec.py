"""The controller-spec grammar of ``--controllers``, ``sim.controllers`` and ``compare``, and
the kinds ``controller.kind`` takes: one table, ``CONTROLLER_SPECS``. The classes behind the
names are registered in ``sagc_jax.controller.registry`` (a test keeps both equal)."""

from __future__ import annotations

from sagc_jax.config.base import ConfigError

__all__ = ["CONTROLLER_SPECS", "HYBRID_MODES", "parse_controller_spec"]

HYBRID_MODES = ("step", "per_prompt")

# kind -> what may follow "kind:": () nothing; "G" a group size, required; a tuple of modes,
# optional (without one, the mode of the kind's config section)
CONTROLLER_SPECS: dict[str, tuple[str, ...] | str] = {
    "sagc": (),
    "sagc_plus": (),
    "sagc_value": (),
    "hybrid": HYBRID_MODES,
    "fixed": "G",
}


def parse_controller_spec(spec: str) -> tuple[str, int | str | None]:
    """A controller spec string as ``(kind, argument)``; anything else is a ConfigError.

    ``'sagc'`` -> ("sagc", None); ``'fixed:8'`` -> ("fixed", 8); ``'hybrid'`` -> ("hybrid",
    None) (the mode of ``controller.hybrid.mode``); ``'hybrid:per_prompt'`` -> ("hybrid",
    "per_prompt").
    """
    kind, sep, arg = spec.partition(":")
    grammar = CONTROLLER_SPECS.get(kind)
    if grammar == "G" and arg.isdigit() and int(arg) >= 1:
        return kind, int(arg)
    if isinstance(grammar, tuple) and (not sep or arg in grammar):
        return kind, arg if sep else None
    raise ConfigError(f"controller spec {spec!r} is not allowed; use {_allowed()}")


def _allowed() -> str:
    """The spec forms, those without an argument first, then a size, then modes."""
    plain = [f"'{k}'" for k, grammar in CONTROLLER_SPECS.items() if grammar == ()]
    sized = [f"'{k}:<G>' with G >= 1" for k, grammar in CONTROLLER_SPECS.items() if grammar == "G"]
    modes = [
        form
        for k, grammar in CONTROLLER_SPECS.items()
        if grammar not in ((), "G")
        for form in (f"'{k}'", *(f"'{k}:{mode}'" for mode in grammar))
    ]
    forms = plain + sized + modes
    return ", ".join(forms[:-1]) + " or " + forms[-1]
