"""Scale-out: device mesh, shardings and multi-process runs (see ``mesh``, ``placement`` and
``distributed``)."""

from sagc_jax.parallel.distributed import (
    EXIT_PEER_LOST,
    any_process,
    from_leader,
    gather_rows,
    initialize,
    is_leader,
    watch_peers,
)
from sagc_jax.parallel.mesh import BATCH_AXES, MESH_AXES, RULES, make_mesh, mesh_shape
from sagc_jax.parallel.placement import ShardingPlan, bytes_per_device

__all__ = [
    "BATCH_AXES",
    "EXIT_PEER_LOST",
    "MESH_AXES",
    "RULES",
    "ShardingPlan",
    "any_process",
    "bytes_per_device",
    "from_leader",
    "gather_rows",
    "initialize",
    "is_leader",
    "make_mesh",
    "mesh_shape",
    "watch_peers",
]
