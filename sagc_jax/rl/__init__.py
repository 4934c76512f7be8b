"""GRPO/DAPO/Dr. GRPO objectives, group advantages and DAPO shaping (pure functions)."""

from sagc_jax.rl.advantages import group_advantages
from sagc_jax.rl.losses import (
    ALGORITHMS,
    kl_k3,
    loss_normalizer,
    policy_loss,
    weighted_policy_loss,
)
from sagc_jax.rl.shaping import completion_mask, informative_groups, overlong_penalty

__all__ = [
    "ALGORITHMS",
    "completion_mask",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "loss_normalizer",
    "overlong_penalty",
    "policy_loss",
    "weighted_policy_loss",
]
