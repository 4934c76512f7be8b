"""Host-side group-size controllers (numpy only; never imports jax)."""

from sagc_jax.config import SAGCConfig
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.factory import make_controller
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.observation import (
    group_ratios,
    padding_waste,
    straggler_observation,
)
from sagc_jax.controller.sagc import SAGCController

__all__ = [
    "FixedGroupController",
    "GroupController",
    "SAGCConfig",
    "SAGCController",
    "group_ratios",
    "make_controller",
    "padding_waste",
    "straggler_observation",
]
