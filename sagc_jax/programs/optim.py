"""The optimizer: AdamW with linear warm-up, optional cosine decay and global-norm clipping."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def make_optimizer(
    learning_rate: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    state_dtype: str = "float32",
    param_dtype: str = "float32",
) -> optax.GradientTransformation:
    """AdamW on a warm-up (+ cosine) schedule counted in optimizer updates, after clipping.

    state_dtype: "float32" keeps the moments (and the update arithmetic) in float32 and, for
    low-precision ``param_dtype``, a float32 master copy of the parameters; "param" keeps the
    moments in the parameters' dtype and no master copy (the least memory, lossy in bfloat16).
    """
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    if schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1)
        )
    elif schedule == "constant":
        lr = (
            optax.join_schedules(
                [
                    optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                    optax.constant_schedule(learning_rate),
                ],
                [warmup_steps],
            )
            if warmup_steps > 0
            else optax.constant_schedule(learning_rate)
        )
    else:
        raise ValueError(f"schedule = {schedule!r}; choose 'constant' or 'cosine'")
    parts = [optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay)]
    if max_grad_norm > 0:
        parts.insert(0, optax.clip_by_global_norm(max_grad_norm))
    tx = optax.chain(*parts)
    if state_dtype == "float32" and param_dtype != "float32":
        return with_float32_master(tx)
    return tx  # float32 params: the moments are float32 already


def _to_f32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


class MasterState(NamedTuple):
    master: optax.Params  # float32 copy of the low-precision parameters
    inner: optax.OptState


def with_float32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed precision for low-precision (bfloat16) parameters: ``inner`` runs in float32 on a
    float32 master copy kept in the optimizer state; the updates it returns move each parameter
    to its master value rounded to the parameter's dtype. Without the master copy, steps smaller
    than the parameter's rounding step (an lr of 1e-6 on weights near 0.02 in bfloat16) are lost.
    """

    def init(params):
        master = _to_f32(params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params):
        step, inner_state = inner.update(_to_f32(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, step)
        # float32 updates: optax.apply_updates adds in float32, then rounds to the param dtype.
        updates = jax.tree.map(lambda m, p: m - p.astype(jnp.float32), master, params)
        return updates, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)
