"""Scale-out: device mesh, shardings and multi-process runs (see ``mesh``, ``placement``,
``distributed`` and ``supervisor``).

The names below load their module on first use, so that importing ``sagc_jax.parallel.supervisor``
(the parent process of a multi-process run's rank, which only passes output through) does not
import jax.
"""

from sagc_jax.lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
