"""Logical axis names for parameters and activations.

Every parameter carries its logical axes in the `out_sharding` metadata of its `nnx.Param`
(`nnx.get_partition_spec(state)` reads them) and the main activations go through `constrain`, so a
mesh plus logical-axis rules (`flax.core.spmd.logical_axis_rules`) shard the model without editing
it. Without rules `constrain` is the identity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import spmd as linen_spmd

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
# Activation axes.
BATCH = "activation_batch"
LENGTH = "activation_length"
ACT_EMBED = "activation_embed"
ACT_MLP = "activation_mlp"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_VOCAB = "activation_vocab"
CACHE_LENGTH = "cache_length"


def param(
    key: jax.Array | None,
    init: str,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    dtype,
    fan_in: int = 1,
    index: int = 0,
) -> nnx.Param:
    """A parameter with logical axes `axes` (one name per dimension of `shape`).

    `init` is "normal" (std 1/sqrt(fan_in), drawn from fold_in(key, index)), "zeros" or "ones".
    The logical names are kept as metadata only (no eager sharding), so building the model needs
    no mesh.
    """
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {shape} given {len(axes)} axis names {axes}")
    if init == "normal":
        value = _scaled_normal(key, index, fan_in**-0.5, shape, jnp.dtype(dtype))
    elif init == "zeros":
        value = jnp.asarray(np.zeros(shape), dtype)  # numpy: no XLA compile per shape
    elif init == "ones":
        value = jnp.asarray(np.ones(shape), dtype)
    else:
        raise ValueError(f"unknown init {init!r}; allowed: normal, zeros, ones")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _scaled_normal(key, index, scale, shape: tuple[int, ...], dtype) -> jax.Array:
    # One compiled program per shape rather than one per op: eager init compiles much less.
    key = jax.random.fold_in(key, index)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical names; a no-op unless logical-axis rules are active."""
    return linen_spmd.with_logical_constraint(x, jax.sharding.PartitionSpec(*axes))
