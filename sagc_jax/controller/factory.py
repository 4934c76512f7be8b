"""Build a controller from a spec string (``'sagc'``, ``'sagc_plus'``, ``'sagc_value'``,
``'fixed:8'``, ``'hybrid:per_prompt'``) or the config section, through ``registry.CONTROLLERS``."""

from __future__ import annotations

from sagc_jax.config import ControllerConfig
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.registry import CONTROLLERS, parse_controller_spec
from sagc_jax.controller.sagc_value import StepSeconds


def make_controller(
    spec: str | ControllerConfig,
    config: ControllerConfig | None = None,
    step_seconds: StepSeconds | None = None,
) -> GroupController:
    """A fresh controller.

    ``spec`` is a :class:`ControllerConfig` or a string ``'sagc'`` / ``'sagc_plus'`` /
    ``'sagc_value'`` / ``'fixed:G'`` / ``'hybrid'`` / ``'hybrid:<mode>'``; with a string, the
    shared straggler budget (``controller.*``: ladder, tau, scope, delta, g_init) and each
    controller's own section come from ``config`` (defaults if None), the mode from the string
    if it has one. ``step_seconds``: the modeled seconds of a step from its lengths ``[P, G]``,
    read by a controller with ``weighs_step_time`` only (None: its default, decode slots).
    """
    if isinstance(spec, ControllerConfig):
        config = spec
        CONTROLLERS.check(spec.kind)
        spec = CONTROLLERS[spec.kind].spec_of(spec.kind, spec)
    kind, arg = parse_controller_spec(spec)
    return CONTROLLERS[kind].build(config or ControllerConfig(), arg, step_seconds)


__all__ = ["GroupController", "make_controller"]
