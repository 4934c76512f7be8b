"""Scale-out: device mesh, shardings and multi-process runs (see ``mesh``, ``placement``,
``distributed`` and ``supervisor``).

The names below load their module on first use, so that importing ``sagc_jax.parallel.supervisor``
(the parent process of a multi-process run's rank, which only passes output through) does not
import jax.
"""

import importlib

_HOMES = {
    "EXIT_PEER_LOST": "supervisor",
    "any_process": "distributed",
    "from_leader": "distributed",
    "gather_rows": "distributed",
    "initialize": "distributed",
    "is_leader": "distributed",
    "watch_peers": "distributed",
    "BATCH_AXES": "mesh",
    "MESH_AXES": "mesh",
    "RULES": "mesh",
    "make_mesh": "mesh",
    "mesh_shape": "mesh",
    "ShardingPlan": "placement",
    "bytes_per_device": "placement",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
