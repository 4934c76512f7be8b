"""Logical axis names for parameters and activations, and how rules turn them into shardings.

Every parameter carries its logical axes in the `out_sharding` metadata of its `nnx.Param`
(`nnx.get_partition_spec(state)` reads them) and the main activations go through `constrain`, so a
mesh plus logical-axis rules (`sagc_jax.parallel`) shard the model without editing it. Outside a
`sharding_rules` context `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
    kind: type[nnx.Param] = nnx.Param,
) -> nnx.Param:
    """A parameter with logical axes `axes` (one name per dimension of `shape`).

    `init` is "normal" (std 1/sqrt(fan_in), drawn from fold_in(key, index)), "zeros" or "ones".
    The logical names are kept as metadata only (no eager sharding), so building the model needs
    no mesh. `kind` is the variable type (a subclass of `nnx.Param`, e.g. the LoRA adapters').
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
    return kind(value, out_sharding=axes, eager_sharding=False)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _scaled_normal(key, index, scale, shape: tuple[int, ...], dtype) -> jax.Array:
    # One compiled program per shape rather than one per op: eager init compiles much less.
    key = jax.random.fold_in(key, index)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


# A rule maps a logical name to mesh axes: one name, a tuple of names, or None (replicated).
Rules = Mapping[str, str | tuple[str, ...] | None]

_ACTIVE: contextvars.ContextVar[tuple[jax.sharding.Mesh, Rules] | None] = contextvars.ContextVar(
    "sagc_jax_sharding_rules", default=None
)


def mesh_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh, rules: Rules
) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have the `logical` names.

    A dimension stays unsharded when its name has no rule, when the mesh axes it maps to have size
    1, when those axes are already used by an earlier dimension, or when they do not divide it
    (e.g. 2 KV heads on a tensor axis of 4): every placement is then valid for every model.
    """
    if len(logical) != len(shape):
        raise ValueError(f"{len(logical)} axis names {tuple(logical)} for shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape, strict=True):
        target = rules.get(name) if name is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(a for a in names if mesh.shape[a] > 1 and a not in used)
        if not names or size % math.prod(mesh.shape[a] for a in names):
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return jax.sharding.PartitionSpec(*spec)


@contextlib.contextmanager
def sharding_rules(mesh: jax.sharding.Mesh, rules: Rules):
    """Within this context (while a program is traced), `constrain` shards over `mesh`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[jax.sharding.Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing `sharding_rules` context, or None outside one."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside `sharding_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = mesh_spec(axes, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
