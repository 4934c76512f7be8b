"""Offline simulator of group-size control (numpy only; never imports jax).

The names below are imported on first use: ``import sagc_jax.sim`` loads none of the simulator.
Its config section, ``sim:``, is :mod:`sagc_jax.config.sim`.
"""

import importlib

_HOMES = {
    "ReplayWorkload": "workload",
    "SimRun": "runner",
    "StepTime": "steptime",
    "StepTimer": "steptime",
    "SyntheticWorkload": "workload",
    "compare": "runner",
    "simulate_controller": "runner",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'sagc_jax.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sagc_jax.sim.{_HOMES[name]}"), name)
