"""Where every array of a run lives on the mesh: ``ShardingPlan``.

Parameters (and the optimizer moments that mirror them) follow their logical axis names through
``RULES``; rollout and update batches are split by rows over ``data x fsdp``; the KV cache is
split by rows and by KV heads; scalars (keys, metrics, the loss normaliser) are replicated.

Multi-process runs: each process holds the rows of its own devices. ``global_rows`` assembles a
global array from every process's local rows and ``local_rows`` gives each process its rows back
(single process: plain placement and fetch).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from sagc_jax.config import MeshConfig
from sagc_jax.models import KVCache
from sagc_jax.models import axes as ax
from sagc_jax.parallel.mesh import BATCH_AXES, MESH_AXES, RULES, batch_shards, make_mesh, mesh_shape


class ShardingPlan:
    """The shardings of parameters, optimizer state, batches and KV cache on one mesh."""

    def __init__(self, mesh: jax.sharding.Mesh, rules=RULES):
        self.mesh = mesh
        self.rules = rules
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
        self.batch_shards = batch_shards(mesh)

    @classmethod
    def from_config(cls, cfg: MeshConfig, devices=None) -> ShardingPlan:
        return cls(make_mesh(cfg, devices))

    @classmethod
    def abstract(cls, cfg: MeshConfig, num_devices: int) -> ShardingPlan:
        """The plan of ``cfg`` on an ``AbstractMesh`` of ``num_devices``: shardings of shapes,
        no device attached (``sagc-jax plan`` for any slice)."""
        sizes = mesh_shape(cfg, num_devices)
        return cls(AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES))

    def describe(self) -> str:
        sizes = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        return f"mesh {sizes} over {self.mesh.size} {self.mesh.devices.flat[0].platform} devices"

    # ------------------------------------------------------------------ shardings

    def named(self, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, ax.mesh_spec(logical, shape, self.mesh, self.rules))

    def params(self, state: nnx.State):
        """Shardings of a model state (concrete or abstract) from its logical axis names."""
        specs = nnx.get_partition_spec(state)
        return jax.tree.map(lambda x, spec: self.named(tuple(spec), x.shape), state, specs)

    def opt_state(self, tx: optax.GradientTransformation, opt_state, param_shardings):
        """Shardings of an optimizer state: moments as their parameters, the rest replicated."""
        return optax.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            opt_state,
            param_shardings,
            transform_non_params=lambda _: self.replicated,
        )

    def for_decoding(self, param_shardings):
        """Parameter shardings for the decode loop: gathered over ``fsdp`` (still split over
        ``tensor``). A decode step touches every weight for one token per row; gathering once
        per rollout beats gathering in every step of the loop."""

        def drop_fsdp(sharding: NamedSharding) -> NamedSharding:
            spec = [_without(entry, "fsdp") for entry in sharding.spec]
            return NamedSharding(self.mesh, PartitionSpec(*spec))

        return jax.tree.map(drop_fsdp, param_shardings)

    def cache(self, cache: KVCache) -> KVCache:
        """Shardings of a KV cache (each block of one, see `KVCache`): rows over data x fsdp,
        KV heads over tensor."""
        k = (ax.BATCH, ax.ACT_KV_HEADS, None, ax.CACHE_LENGTH)
        v = (ax.BATCH, ax.ACT_KV_HEADS, ax.CACHE_LENGTH, None)
        return KVCache(
            k_lbkhs=jax.tree.map(lambda x: self.named(k, x.shape), cache.k_lbkhs),
            v_lbksh=jax.tree.map(lambda x: self.named(v, x.shape), cache.v_lbksh),
            start_b=self.rows,
            index=self.rows if cache.index.ndim == 1 else self.replicated,  # per row, or one
        )

    def activate(self):
        """Context in which programs are traced: activation constraints follow the rules."""
        return ax.sharding_rules(self.mesh, self.rules)

    # ------------------------------------------------------------------ placement

    def global_rows(self, local):
        """Global arrays (rows over data x fsdp) from each process's local rows (numpy)."""
        if jax.process_count() == 1:
            return jax.device_put(local, self.rows)
        spec = PartitionSpec(BATCH_AXES)
        return multihost_utils.host_local_array_to_global_array(local, self.mesh, spec)

    def local_rows(self, tree):
        """This process's rows of row-sharded global arrays, as numpy; scalars whole."""

        def one(x):
            if jax.process_count() == 1 or x.ndim == 0:
                return np.asarray(jax.device_get(x))
            spec = PartitionSpec(BATCH_AXES)
            local = multihost_utils.global_array_to_host_local_array(x, self.mesh, spec)
            return np.asarray(local)

        return jax.tree.map(one, tree)


def _without(entry, axis: str):
    """A PartitionSpec entry (None, a mesh axis or a tuple of them) with ``axis`` removed."""
    names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != axis)
    return names[0] if len(names) == 1 else names or None


def bytes_per_device(tree) -> int:
    """Bytes of ``tree``'s arrays (concrete, or ShapeDtypeStructs with a sharding) held by the
    most loaded device; unsharded abstract leaves count whole."""
    per_device: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        itemsize = np.dtype(leaf.dtype).itemsize
        if sharding is None:
            per_device[-1] = per_device.get(-1, 0) + math.prod(leaf.shape) * itemsize
            continue
        shard_bytes = math.prod(sharding.shard_shape(leaf.shape)) * itemsize
        for device in sharding.device_set:
            per_device[device.id] = per_device.get(device.id, 0) + shard_bytes
    whole = per_device.pop(-1, 0)
    return whole + max(per_device.values(), default=0)
