"""The optimizer: AdamW with linear warm-up, optional cosine decay and global-norm clipping."""

from __future__ import annotations

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
) -> optax.GradientTransformation:
    """AdamW on a warm-up (+ cosine) schedule counted in optimizer updates, after clipping."""
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
    return optax.chain(*parts)
