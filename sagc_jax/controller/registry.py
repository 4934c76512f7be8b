"""Every controller kind, one entry each: the name ``controller.kind`` and the specs of
``--controllers`` use (their grammar is ``config.spec.CONTROLLER_SPECS``; a test keeps the two
equal), the class, how the config builds one, and what the rest of the trainer asks of it.

Adding a controller is a module with its class and an entry here (docs/architecture.md, "Add a
controller"); its metrics reach the run's log through the class's ``logged_metrics``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sagc_jax.config import ControllerConfig
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.hybrid import HybridController
from sagc_jax.controller.sagc import SAGCController
from sagc_jax.controller.sagc_plus import SAGCPlusController
from sagc_jax.controller.sagc_value import SAGCValueController, StepSeconds

# (the shared budget and the kind's own sections, the spec's argument or None, the modeled
# seconds of a step or None) -> a fresh controller
Build = Callable[[ControllerConfig, Any, StepSeconds | None], GroupController]


@dataclasses.dataclass(frozen=True)
class ControllerEntry:
    """One controller kind.

    ``cls``: its class; ``build``: a fresh one from the config; ``seeded``: the name of its
    config section whose ``seed`` drives a random generator (``compare`` offsets it per seed),
    None for a deterministic controller.
    """

    cls: type[GroupController]
    build: Build
    seeded: str | None = None


def _hybrid(config: ControllerConfig, mode, _step_seconds) -> HybridController:
    hybrid = config.hybrid if mode is None else dataclasses.replace(config.hybrid, mode=mode)
    return HybridController(config, hybrid)


CONTROLLERS: dict[str, ControllerEntry] = {
    "sagc": ControllerEntry(
        SAGCController, lambda config, _, __: SAGCController(config, config.sagc), "sagc"
    ),
    "sagc_plus": ControllerEntry(
        SAGCPlusController, lambda config, _, __: SAGCPlusController(config, config.sagc_plus)
    ),
    "sagc_value": ControllerEntry(
        SAGCValueController,
        lambda config, _, step_seconds: SAGCValueController(
            config, config.sagc_plus, config.sagc_value, step_seconds
        ),
    ),
    "hybrid": ControllerEntry(HybridController, _hybrid, "hybrid"),
    "fixed": ControllerEntry(
        FixedGroupController,
        lambda config, size, _: FixedGroupController(size, tau=config.tau, scope=config.scope),
    ),
}
