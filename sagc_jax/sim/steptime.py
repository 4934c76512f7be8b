"""Step-time model of synchronous on-policy training (seconds of an illustrative accelerator).

Rollout: one prefill of all prompts, then decode steps until the longest sequence of the step
ends (early exit), each decode step costing a fixed latency plus a per-sequence term.
Update: proportional to the tokens processed (prompts plus actual completion tokens).
Only ratios between controllers are meaningful; the constants are in :class:`SimConfig`.
"""

from __future__ import annotations

import numpy as np

from sagc_jax.config import SimConfig


def step_seconds(lengths_pg: np.ndarray, prompt_tokens: int, cfg: SimConfig) -> tuple[float, float]:
    """``(rollout_seconds, update_seconds)`` of one step with response lengths ``[P, G]``."""
    num_seqs = lengths_pg.size
    prefill = cfg.prefill_token_seconds * num_seqs * prompt_tokens
    decode_step = cfg.decode_step_seconds + cfg.decode_seq_seconds * num_seqs
    rollout = prefill + int(lengths_pg.max()) * decode_step
    tokens = num_seqs * prompt_tokens + int(lengths_pg.sum())
    update = cfg.step_overhead_seconds + cfg.update_token_seconds * tokens
    return rollout, update
