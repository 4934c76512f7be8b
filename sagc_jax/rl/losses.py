"""Clipped policy-gradient losses of GRPO, DAPO and Dr. GRPO: arrays in, (loss, metrics) out.

Shapes: B sequences (a mini-batch of the step), T completion positions. Log-probabilities are
float32 per token of the sampled completion; ``mask_bt`` is 1 on completion tokens.

The three objectives differ only in how per-token terms are aggregated:
- ``seq_mean`` (GRPO): mean over tokens of each sequence, then mean over sequences;
- ``token_mean`` (DAPO): mean over all completion tokens of the step;
- ``constant`` (Dr. GRPO): sum over tokens divided by (sequences x max completion length).
The normaliser is a whole-step quantity (:func:`loss_normalizer`), so summing the losses of
mini-batches gives the loss of the full batch: gradient accumulation is exact.
:func:`weighted_policy_loss` is the same objective on packed rows, the aggregation folded into
per-token weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from sagc_jax.config import Registry


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How a step's per-token loss terms become one number: ``sum(weight * term) / normaliser``.

    ``per_sequence``: a scored token's weight is 1 over its sequence's scored tokens (a mean per
    sequence), else 1. ``share``: each rollout's share of the step's normaliser from its scored
    tokens ``tokens_b`` (float, numpy or jax) and the configured cap; the normaliser is their
    sum, a whole-step quantity, so the losses of mini-batches or packed rows sum to the loss of
    the full batch. Adding an aggregation is an entry in ``AGGREGATIONS`` (docs/architecture.md,
    "Add a loss aggregation"): the padded loss
    (:func:`policy_loss`), the packed rows (``programs.packing``) and :func:`loss_normalizer`
    read it.
    """

    per_sequence: bool
    share: Callable[[Any, int | None], Any]


def _cap_share(tokens_b, max_new_tokens: int | None):
    if max_new_tokens is None:
        raise ValueError("aggregation 'constant' needs max_new_tokens")
    return tokens_b * 0.0 + float(max_new_tokens)  # every rollout, fully masked ones included


AGGREGATIONS: dict[str, Aggregation] = {
    # GRPO: mean over the tokens of each sequence, then over the sequences with a scored token
    "seq_mean": Aggregation(True, lambda tokens_b, _: (tokens_b > 0) * 1.0),
    # DAPO: mean over every completion token of the step
    "token_mean": Aggregation(False, lambda tokens_b, _: tokens_b),
    # Dr. GRPO: sum over tokens over (sequences x max_new_tokens)
    "constant": Aggregation(False, _cap_share),
}


def aggregation_of(name: str) -> Aggregation:
    """The entry of ``name`` in ``AGGREGATIONS``; ValueError naming the allowed ones."""
    if name not in AGGREGATIONS:
        raise ValueError(f"aggregation = {name!r}; choose one of {list(AGGREGATIONS)}")
    return AGGREGATIONS[name]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A GRPO-family algorithm (``loss.algorithm``): how its loss aggregates tokens (a key of
    ``AGGREGATIONS``), whether its advantages are divided by the group's reward std, and its
    line in ``loss.algorithm``'s help. Adding a loss is an entry in ``ALGORITHMS``
    (docs/architecture.md, "Add a loss")."""

    name: str
    aggregation: str
    scale_by_std: bool
    help: str = ""


ALGORITHMS = Registry(
    "loss.algorithm",
    (
        (a.name, a)
        for a in (
            Algorithm(
                "grpo",
                aggregation="seq_mean",
                scale_by_std=True,
                help="advantages scaled by the group's std, sequence-mean loss",
            ),
            Algorithm(
                "dapo",
                aggregation="token_mean",
                scale_by_std=True,
                help="token-mean loss (clip-higher through eps_high)",
            ),
            Algorithm(  # Dr. GRPO
                "dr_grpo",
                aggregation="constant",
                scale_by_std=False,
                help="no std scaling, a constant normaliser",
            ),
        )
    ),
)


def loss_normalizer(mask_bt, aggregation: str, max_new_tokens: int | None = None) -> jax.Array:
    """The denominator of the step's loss, computed once over the full rollout batch.

    seq_mean: number of sequences with at least one unmasked token; token_mean: number of
    unmasked tokens; constant: number of sequences x ``max_new_tokens`` (the configured cap,
    not the padded width).
    """
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    chex.assert_rank(mask_bt, 2)  # [B, T]: 'constant' counts its rows as the sequences
    share_b = aggregation_of(aggregation).share(jnp.sum(mask_bt, axis=1), max_new_tokens)
    return jnp.maximum(jnp.sum(share_b).astype(jnp.float32), 1.0)


def kl_k3(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(policy || reference): ``exp(r - p) - (r - p) - 1 >= 0``."""
    diff = ref_logp_bt - logp_bt
    return jnp.exp(diff) - diff - 1.0


def _check_token_arrays(logp_bt, old_logp_bt, mask_bt, ref_logp_bt) -> None:
    """The per-token contract of both losses (checked when traced: no cost per call under jit):
    log-probs and mask alike [B, T]; log-probs float32 (in bfloat16 the ratio exp(logp - old)
    moves in steps of 1/128 near 1)."""
    logps = [logp_bt, old_logp_bt] + ([] if ref_logp_bt is None else [ref_logp_bt])
    chex.assert_rank(logp_bt, 2)
    chex.assert_equal_shape([*logps, mask_bt])
    chex.assert_type(logps, jnp.float32)


def _token_terms(
    logp_bt, old_logp_bt, adv_bt, mask_bt, eps_low, eps_high, kl_beta, ref_logp_bt
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(per-token loss terms [B, T], per-token metrics as means over the unmasked tokens).

    Off the mask the log-probs are replaced by values giving ratio 1 and KL 0, so a padding
    position never turns a 0 weight into a NaN (0 x inf), in the value or the gradient.
    """
    live_bt = mask_bt > 0
    logp_bt = jnp.where(live_bt, logp_bt, old_logp_bt)
    ratio_bt = jnp.exp(logp_bt - old_logp_bt)
    unclipped = ratio_bt * adv_bt
    clipped = jnp.clip(ratio_bt, 1.0 - eps_low, 1.0 + eps_high) * adv_bt
    per_token = -jnp.minimum(unclipped, clipped)
    num_tokens = jnp.maximum(jnp.sum(mask_bt), 1.0)
    metrics = {}
    if kl_beta > 0.0:
        if ref_logp_bt is None:
            raise ValueError("kl_beta > 0 needs ref_logp_bt (log-probs of the reference policy)")
        kl_bt = kl_k3(logp_bt, jnp.where(live_bt, ref_logp_bt, logp_bt))
        per_token = per_token + kl_beta * kl_bt
        metrics["kl"] = jnp.sum(kl_bt * mask_bt) / num_tokens
    # tokens whose gradient the clip removed (the min picked the clipped, constant term)
    high = (ratio_bt > 1.0 + eps_high) & (adv_bt > 0)
    low = (ratio_bt < 1.0 - eps_low) & (adv_bt < 0)
    is_clipped = (high | low) & live_bt
    metrics["clip_fraction"] = jnp.sum(is_clipped) / num_tokens
    metrics["ratio_mean"] = jnp.sum(ratio_bt * mask_bt) / num_tokens
    return per_token, metrics


def policy_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_b: jax.Array,
    mask_bt: jax.Array,
    normalizer: jax.Array,
    *,
    aggregation: str,
    eps_low: float,
    eps_high: float,
    kl_beta: float = 0.0,
    ref_logp_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clipped surrogate with optional k3 KL penalty; returns (scalar loss, metrics).

    Args:
      logp_bt: float32 [B, T] log-probs of the sampled tokens under the policy being updated.
      old_logp_bt: float32 [B, T] the same under the policy that generated them (rollout time).
      adv_b: float32 [B] sequence advantages (broadcast over tokens).
      mask_bt: float32 [B, T] 1 on completion tokens.
      normalizer: scalar from :func:`loss_normalizer` over the whole step.
      aggregation: one of ``AGGREGATIONS``.
      eps_low, eps_high: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]`` (DAPO's
        clip-higher uses eps_high > eps_low).
      kl_beta: coefficient of the KL penalty; needs ``ref_logp_bt`` when > 0.

    Metrics (kl, clip_fraction, ratio_mean) are means over the unmasked tokens.
    """
    _check_token_arrays(logp_bt, old_logp_bt, mask_bt, ref_logp_bt)
    chex.assert_shape(adv_b, logp_bt.shape[:1])  # [B]: a [B, T] one would broadcast to [B, B, T]
    chex.assert_rank(normalizer, 0)
    mask_bt = mask_bt.astype(jnp.float32)
    per_token, metrics = _token_terms(
        logp_bt, old_logp_bt, adv_b[:, None], mask_bt, eps_low, eps_high, kl_beta, ref_logp_bt
    )
    if aggregation_of(aggregation).per_sequence:  # the sequences' means, summed
        tokens_b = jnp.sum(mask_bt, axis=1)
        total = jnp.sum(jnp.sum(per_token * mask_bt, axis=1) / jnp.maximum(tokens_b, 1.0))
    else:
        total = jnp.sum(per_token * mask_bt)
    return total / normalizer, metrics


def token_weights(mask_l: np.ndarray, aggregation: str) -> np.ndarray:
    """The weights of one sequence's scored tokens in the step's loss under ``aggregation``
    (``mask_l`` its mask, not all 0): the mask, over its scored tokens where the aggregation is
    ``per_sequence`` (what :func:`policy_loss` computes, folded into weights for packed rows)."""
    return mask_l / mask_l.sum() if aggregation_of(aggregation).per_sequence else mask_l


def weighted_policy_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    weight_bt: jax.Array,
    normalizer: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    kl_beta: float = 0.0,
    ref_logp_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`policy_loss` with the aggregation folded into per-token weights (packed rows).

    ``loss = sum(weight_bt * per_token_term) / normalizer``: seq_mean, token_mean and constant
    differ only in the weights and the normaliser (see ``programs.packing``), so the loss of any
    split of the tokens sums to the loss of the whole. All arrays float32 [B, T] (B packed rows,
    T tokens); ``adv_bt`` per token; ``mask_bt`` 1 where a completion token is scored. Metrics as
    :func:`policy_loss`'s.
    """
    _check_token_arrays(logp_bt, old_logp_bt, mask_bt, ref_logp_bt)
    chex.assert_equal_shape([logp_bt, adv_bt, weight_bt])
    chex.assert_rank(normalizer, 0)
    per_token, metrics = _token_terms(
        logp_bt, old_logp_bt, adv_bt, mask_bt, eps_low, eps_high, kl_beta, ref_logp_bt
    )
    return jnp.sum(per_token * weight_bt) / normalizer, metrics
