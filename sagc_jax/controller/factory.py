"""Build a controller from a spec string (``'sagc'``, ``'fixed:8'``) or the config section."""

from __future__ import annotations

from sagc_jax.config import ControllerConfig, parse_controller_spec
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.sagc import SAGCController


def make_controller(spec: str | ControllerConfig, config: ControllerConfig | None = None):
    """A fresh controller.

    ``spec`` is a :class:`ControllerConfig` or a string ``'sagc'`` / ``'fixed:G'``; with a string,
    SAGC knobs and the straggler definition (tau, scope) come from ``config`` (defaults if None).
    """
    if isinstance(spec, ControllerConfig):
        config = spec
        spec = "sagc" if spec.kind == "sagc" else f"fixed:{spec.group_size}"
    config = config or ControllerConfig()
    kind, group_size = parse_controller_spec(spec)
    if kind == "sagc":
        return SAGCController(config.sagc)
    return FixedGroupController(group_size, tau=config.sagc.tau, scope=config.sagc.scope)


__all__ = ["GroupController", "make_controller"]
