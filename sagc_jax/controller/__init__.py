"""Host-side group-size controllers (numpy only; never imports jax)."""

from sagc_jax.config import HybridConfig, SAGCConfig, SAGCPlusConfig, SAGCValueConfig
from sagc_jax.controller.allocation import allocate
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.factory import make_controller
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.hybrid import HybridController
from sagc_jax.controller.observation import (
    check_ragged_lengths,
    group_ratios,
    padding_waste,
    ragged_median_ratio,
    straggler_observation,
)
from sagc_jax.controller.predictor import StragglePredictor
from sagc_jax.controller.prompt_stats import PromptStats
from sagc_jax.controller.registry import CONTROLLERS, parse_controller_spec
from sagc_jax.controller.sagc import SAGCController
from sagc_jax.controller.sagc_plus import SAGCPlusController
from sagc_jax.controller.sagc_value import SAGCValueController
from sagc_jax.controller.step import StepObservation, varied_groups

__all__ = [
    "CONTROLLERS",
    "FixedGroupController",
    "GroupController",
    "HybridConfig",
    "HybridController",
    "PromptStats",
    "SAGCConfig",
    "SAGCController",
    "SAGCPlusConfig",
    "SAGCPlusController",
    "SAGCValueConfig",
    "SAGCValueController",
    "StepObservation",
    "StragglePredictor",
    "allocate",
    "check_ragged_lengths",
    "group_ratios",
    "make_controller",
    "parse_controller_spec",
    "varied_groups",
    "padding_waste",
    "ragged_median_ratio",
    "straggler_observation",
]
