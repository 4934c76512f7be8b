"""Offline simulator of group-size control (numpy only; never imports jax)."""

from sagc_jax.sim.runner import SimRun, compare, run_controller
from sagc_jax.sim.steptime import StepTime, StepTimer
from sagc_jax.sim.workload import ReplayWorkload, SyntheticWorkload

__all__ = [
    "ReplayWorkload",
    "SimRun",
    "StepTime",
    "StepTimer",
    "SyntheticWorkload",
    "compare",
    "run_controller",
]
