"""Reward shaping and loss masks on token counts (DAPO): arrays in, arrays out (numpy).

These run on the host between rollout and update, next to the reward functions.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths_b, max_new_tokens: int, buffer_tokens: int, factor: float = 1.0):
    """DAPO soft overlong punishment, float32 [B] (added to the reward).

    0 up to ``max_new_tokens - buffer_tokens``; then falls linearly to ``-factor`` at
    ``max_new_tokens``; clamped at ``-factor`` beyond. ``buffer_tokens = 0`` disables it.
    """
    lengths_b = np.asarray(lengths_b, dtype=np.float64)
    if buffer_tokens <= 0:
        return np.zeros(lengths_b.shape, np.float32)
    start = max_new_tokens - buffer_tokens
    penalty = np.clip((lengths_b - start) / buffer_tokens, 0.0, 1.0) * -factor
    return penalty.astype(np.float32)


def informative_groups(rewards_pg) -> np.ndarray:
    """bool [P]: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    rewards_pg = np.asarray(rewards_pg)
    return rewards_pg.max(axis=1) > rewards_pg.min(axis=1)


def completion_mask(lengths_b, width: int, truncated_b=None) -> np.ndarray:
    """float32 [B, width]: 1 on the tokens of each completion (EOS included), 0 on padding.

    With ``truncated_b`` given (DAPO overlong filtering), truncated rows are masked out entirely.
    """
    lengths_b = np.asarray(lengths_b)
    mask_bt = (np.arange(width)[None, :] < lengths_b[:, None]).astype(np.float32)
    if truncated_b is not None:
        mask_bt *= ~np.asarray(truncated_b, dtype=bool)[:, None]
    return mask_bt
