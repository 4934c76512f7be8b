"""The controller-spec grammar of ``--controllers``, ``sim.controllers`` and ``compare``:
``sagc``, ``sagc_plus``, ``sagc_value``, ``fixed:<G>``, ``hybrid[:mode]``."""

from __future__ import annotations

from sagc_jax.config.base import ConfigError

__all__ = ["HYBRID_MODES", "parse_controller_spec"]

HYBRID_MODES = ("step", "per_prompt")


def parse_controller_spec(spec: str) -> tuple[str, int | str | None]:
    """A controller spec string as ``(kind, argument)``; anything else is a ConfigError.

    ``'sagc'`` -> ("sagc", None); ``'sagc_plus'`` -> ("sagc_plus", None); ``'sagc_value'`` ->
    ("sagc_value", None); ``'fixed:8'`` ->
    ("fixed", 8); ``'hybrid'`` -> ("hybrid", None) (the mode of ``controller.hybrid.mode``);
    ``'hybrid:step'`` -> ("hybrid", "step"); ``'hybrid:per_prompt'`` -> ("hybrid", "per_prompt").
    """
    kind, sep, arg = spec.partition(":")
    if kind in ("sagc", "sagc_plus", "sagc_value") and not sep:
        return kind, None
    if kind == "fixed" and arg.isdigit() and int(arg) >= 1:
        return "fixed", int(arg)
    if kind == "hybrid" and not sep:
        return "hybrid", None
    if kind == "hybrid" and arg in HYBRID_MODES:
        return "hybrid", arg
    raise ConfigError(
        f"controller spec {spec!r} is not allowed; use 'sagc', 'sagc_plus', 'sagc_value', "
        f"'fixed:<G>' with "
        f"G >= 1, "
        f"'hybrid', 'hybrid:step' or 'hybrid:per_prompt'"
    )
