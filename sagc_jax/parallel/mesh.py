"""The device mesh (data, fsdp, tensor) and the logical-axis rules that place the model on it.

* ``data``: rollout/update rows split across replicas of the whole model;
* ``fsdp``: rows split as well, and every parameter and optimizer moment split along its
  ``embed`` dimension (gathered layer by layer by XLA when used);
* ``tensor``: attention heads, MLP features and the vocabulary split (Megatron style).

Rows of a batch are split over ``data x fsdp``: that product is the "batch shard" count every
rollout batch must divide by.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType

from sagc_jax.config import ConfigError, MeshConfig
from sagc_jax.models import axes as ax

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axes. Names missing here (head_dim, lengths) are never split.
RULES: dict[str, str | tuple[str, ...] | None] = {
    ax.VOCAB: "tensor",
    ax.EMBED: "fsdp",
    ax.MLP: "tensor",
    ax.Q_HEADS: "tensor",
    ax.KV_HEADS: "tensor",
    ax.BATCH: BATCH_AXES,
    ax.ACT_MLP: "tensor",
    ax.ACT_HEADS: "tensor",
    ax.ACT_KV_HEADS: "tensor",
    ax.ACT_VOCAB: "tensor",
}


def mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 axis (if any) resolved; their product must be ``num_devices``."""
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    free = [k for k, v in sizes.items() if v == -1]
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh {sizes}: {num_devices} devices are not divisible by the fixed axes "
                f"({fixed}); mesh.{free[0]} = -1 needs them to be"
            )
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(
            f"mesh {sizes} needs {math.prod(sizes.values())} devices but {num_devices} are "
            f"available; set one of mesh.data/fsdp/tensor to -1 or match the device count"
        )
    return sizes


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The mesh of ``cfg`` over ``devices`` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(cfg, len(devices))
    # make_mesh orders the devices by the physical topology (ICI rings on TPU slices).
    return jax.make_mesh(
        tuple(sizes[a] for a in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def batch_shards(mesh: jax.sharding.Mesh) -> int:
    """How many pieces the rows of a batch are split into."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)
