"""Build a controller from a spec string (``'sagc'``, ``'sagc_plus'``, ``'sagc_value'``,
``'fixed:8'``, ``'hybrid:per_prompt'``) or the config section."""

from __future__ import annotations

import dataclasses

from sagc_jax.config import ControllerConfig, parse_controller_spec
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.hybrid import HybridController
from sagc_jax.controller.sagc import SAGCController
from sagc_jax.controller.sagc_plus import SAGCPlusController
from sagc_jax.controller.sagc_value import SAGCValueController, StepSeconds


def make_controller(
    spec: str | ControllerConfig,
    config: ControllerConfig | None = None,
    step_seconds: StepSeconds | None = None,
):
    """A fresh controller.

    ``spec`` is a :class:`ControllerConfig` or a string ``'sagc'`` / ``'sagc_plus'`` /
    ``'sagc_value'`` / ``'fixed:G'`` / ``'hybrid'`` / ``'hybrid:<mode>'``; with a string, the
    shared straggler budget (``controller.*``: ladder, tau, scope, delta, g_init) and each
    controller's own section come from ``config`` (defaults if None), the mode from the string
    if it has one. ``step_seconds``: the modeled seconds of a step from its lengths ``[P, G]``,
    read by ``sagc_value`` only (None: its default, decode slots).
    """
    if isinstance(spec, ControllerConfig):
        config = spec
        spec = spec.kind if spec.kind != "fixed" else f"fixed:{spec.group_size}"
    config = config or ControllerConfig()
    kind, arg = parse_controller_spec(spec)
    if kind == "sagc":
        return SAGCController(config, config.sagc)
    if kind == "sagc_plus":
        return SAGCPlusController(config, config.sagc_plus)
    if kind == "sagc_value":
        return SAGCValueController(config, config.sagc_plus, config.sagc_value, step_seconds)
    if kind == "hybrid":
        hybrid = config.hybrid if arg is None else dataclasses.replace(config.hybrid, mode=arg)
        return HybridController(config, hybrid)
    return FixedGroupController(arg, tau=config.tau, scope=config.scope)


__all__ = ["GroupController", "make_controller"]
