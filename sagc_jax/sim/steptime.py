"""Step-time model of synchronous on-policy training (seconds of an illustrative accelerator).

Rollout: one prefill of all prompts, then decode steps until the longest sequence of the step
ends (early exit), each decode step costing a fixed latency plus a per-sequence term.
Update: proportional to the tokens processed (prompts plus actual completion tokens).
Only ratios between controllers are meaningful; the constants are in :class:`SimConfig`.
"""

from __future__ import annotations

import numpy as np

from sagc_jax.config import SimConfig


def step_seconds(lengths, prompt_tokens, cfg: SimConfig) -> tuple[float, float]:
    """``(rollout_seconds, update_seconds)`` of one step.

    ``lengths``: response lengths of every sequence of the step, ``[P, G]`` or flat ``[B]``
    (groups of mixed sizes); ``prompt_tokens``: the prompt length of every sequence (an int)
    or per sequence (an array of ``lengths.size``, in the same order).
    """
    lengths = np.asarray(lengths)
    num_seqs = lengths.size
    if np.ndim(prompt_tokens) == 0:
        prefill = cfg.prefill_token_seconds * num_seqs * prompt_tokens
        prompt_total = num_seqs * prompt_tokens
    else:
        prompt_total = int(np.sum(prompt_tokens))
        prefill = cfg.prefill_token_seconds * prompt_total
    decode_step = cfg.decode_step_seconds + cfg.decode_seq_seconds * num_seqs
    rollout = prefill + int(lengths.max()) * decode_step
    tokens = prompt_total + int(lengths.sum())
    update = cfg.step_overhead_seconds + cfg.update_token_seconds * tokens
    return rollout, update
