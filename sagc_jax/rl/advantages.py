"""Group-relative advantages with segment operations (any G, no hard-wired reshape).

Rows of a rollout batch are sequences; ``group_ids_b`` says which prompt group each belongs to.
Groups may have different sizes (e.g. after dynamic sampling); only ``num_groups`` is static.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def group_advantages(
    rewards_b: jax.Array,
    group_ids_b: jax.Array,
    num_groups: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Advantage of every sequence relative to its group.

    Args:
      rewards_b: float [B] scalar reward per sequence.
      group_ids_b: int [B] group index in ``[0, num_groups)``.
      num_groups: static number of groups P.
      scale_by_std: GRPO/DAPO divide by the group's standard deviation (unbiased, as TRL and
        verl do); Dr. GRPO does not.
      eps: added to the std so all-equal groups give 0, not nan.

    Returns:
      ``adv_b`` float32 [B] and stats: ``mean_p``, ``std_p`` [P] and ``zero_variance_p`` bool [P]
      (groups whose rewards are all equal: their advantages are exactly 0).
    """
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    # [B] both, integer ids: rewards [1, B] would give [B, B] advantages without an error
    chex.assert_rank(rewards_b, 1)
    chex.assert_shape(group_ids_b, rewards_b.shape)
    chex.assert_type(group_ids_b, int)
    seg = lambda x: jax.ops.segment_sum(x, group_ids_b, num_segments=num_groups)  # noqa: E731
    count_p = seg(jnp.ones_like(rewards_b))
    mean_p = seg(rewards_b) / jnp.maximum(count_p, 1.0)
    centred_b = rewards_b - mean_p[group_ids_b]
    var_p = seg(centred_b**2) / jnp.maximum(count_p - 1.0, 1.0)
    std_p = jnp.sqrt(var_p)
    # All-equal is decided on the rewards themselves: a mean of values float32 cannot represent
    # exactly (0.7, 1/3) is an ulp off, so their centred values are not 0 and the std is tiny.
    max_p = jax.ops.segment_max(rewards_b, group_ids_b, num_segments=num_groups)
    min_p = jax.ops.segment_min(rewards_b, group_ids_b, num_segments=num_groups)
    zero_variance_p = (max_p == min_p) | (count_p == 0)
    adv_b = centred_b / (std_p[group_ids_b] + eps) if scale_by_std else centred_b
    adv_b = jnp.where(zero_variance_p[group_ids_b], 0.0, adv_b)
    return adv_b, {"mean_p": mean_p, "std_p": std_p, "zero_variance_p": zero_variance_p}
