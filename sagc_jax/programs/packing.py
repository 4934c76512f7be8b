"""The update's batch on the host (numpy only): a step's real tokens laid end to end in packed
rows, or one padded row per rollout; either way only the rollouts whose gradient can be non-zero.

The padded update runs on ``[rollouts, prompt_bucket + max_new_tokens]``, mostly padding. Here
each rollout becomes one *segment*: its prompt without the left padding, then its completion up
to its last unmasked token (later tokens predict nothing the loss uses). Segments are placed
first-fit-decreasing into rows of ``pack_len`` tokens; attention stays inside a segment
(``segment_ids``) and positions restart at 0 in each (as the padded path counts real tokens).

Layout of the per-token arrays (``PACKED_KEYS``, all [R, pack_len] but ``norm`` [R]):
  tokens       int32, the input tokens (0 on padding);
  positions    int32, 0.. within each segment (0 on padding);
  segment_ids  int32, 1..n in each row, 0 on padding;
  rollout      int32, the id of the token's rollout (its index in the step's rollouts; 0 on
               padding): LoRA dropout draws a token's masks by its rollout and position
               (``models.lora.token_keys``), not by where the packing put it;
  mask, weight, old_logp, adv  float32, stored at the position of the token *before* the
               completion token they score: position s carries the prediction of token s + 1
               (its logits), so the update reads ``log_softmax(logits)[s, tokens[s + 1]]``
               without shifting anything else;
  norm         float32 [R], each row's share of the step's loss normaliser.

The loss is ``sum(weight * per_token_term) / sum(norm)`` (``rl.weighted_policy_loss``): a plain
sum over tokens, so it splits exactly over micro-batches, mini-batches, devices and processes,
and the normaliser is summed over the global batch on the device (each process packs only its
own rollouts). Per aggregation (``rl.loss_normalizer`` / ``rl.policy_loss``):
  seq_mean (GRPO)     weight = mask / tokens of its sequence, norm = 1 per non-empty sequence;
  token_mean (DAPO)   weight = mask,                          norm = tokens;
  constant (Dr. GRPO) weight = mask,                          norm = max_new_tokens per rollout
                      (fully masked rollouts included: they take no room but count here).

Row counts come from a ladder (``row_ladder``) so the update compiles once per rung, whatever G.

Rollouts left out (``trained_b`` False: advantage 0 with no KL term, so their loss and gradient
are exactly 0) take no row, yet their share of the normaliser (``normalizer_shares``) still
counts, in row 0: the loss and gradient equal those of the whole batch. The padded batch
(``padded_update_batch``) does the same with one row per trained rollout, a ``rollout`` [R]
and a ``norm`` [R].
"""

from __future__ import annotations

import math

import chex
import numpy as np

from sagc_jax.config import ConfigError
from sagc_jax.rl.losses import aggregation_of, token_weights

PACKED_KEYS = (
    "tokens",
    "positions",
    "segment_ids",
    "rollout",
    "mask",
    "weight",
    "old_logp",
    "adv",
    "norm",
)
# The padded batch: one row per trained rollout (``rollout`` [R] its id, ``norm`` [R] as the
# packed batch's).
PADDED_KEYS = (
    "prompt_ids",
    "prompt_lens",
    "completion",
    "old_logp",
    "mask",
    "adv",
    "rollout",
    "norm",
)


def normalizer_shares(mask_bl, aggregation: str, max_new_tokens: int) -> np.ndarray:
    """float64 [B]: each rollout's share of the step's loss normaliser (``rl.loss_normalizer``
    is their sum): seq_mean 1 per rollout with a scored token, token_mean its scored tokens,
    constant ``max_new_tokens`` per rollout (fully masked ones included)."""
    mask_bl = np.asarray(mask_bl, np.float64)
    chex.assert_rank(mask_bl, 2)
    share_b = aggregation_of(aggregation).share(mask_bl.sum(axis=1), max_new_tokens)
    return np.asarray(share_b, np.float64)


def _rollout_ids(rollout_b, batch: int) -> np.ndarray:
    """int32 [B] the rollouts' ids (None: 0..B-1)."""
    if rollout_b is None:
        return np.arange(batch, dtype=np.int32)
    rollout_b = np.asarray(rollout_b, np.int32)
    chex.assert_shape(rollout_b, (batch,))
    return rollout_b


def _trained(trained_b, batch: int) -> np.ndarray:
    """bool [B] the rollouts the update trains (None: all of them)."""
    if trained_b is None:
        return np.ones(batch, bool)
    trained_b = np.asarray(trained_b, bool)
    chex.assert_shape(trained_b, (batch,))
    return trained_b


def resolve_pack_len(pack_len: int, prompt_buckets, max_new_tokens: int) -> int:
    """Tokens per packed row: ``pack_len``, or (0) the longest prompt bucket + max_new_tokens.

    A fixed row length (not the step's bucket) keeps one program per rung; it must hold the
    longest possible rollout, so a smaller ``pack_len`` is refused.
    """
    longest = max(prompt_buckets) + max_new_tokens
    if pack_len == 0:
        return longest
    if pack_len < longest:
        raise ConfigError(
            f"train.pack_len = {pack_len} cannot hold the longest rollout (largest prompt bucket "
            f"{max(prompt_buckets)} + sampling.max_new_tokens {max_new_tokens} = {longest}); "
            f"use 0 (that length) or more"
        )
    return pack_len


def row_multiple(minibatches: int, microbatches: int, batch_shards: int, processes: int = 1) -> int:
    """The multiple every process's row count must be: the global rows (``processes`` x rung)
    then divide into ``minibatches x microbatches`` chunks split over ``batch_shards``."""
    whole = minibatches * microbatches * batch_shards
    return whole // math.gcd(whole, processes)


def row_ladder(multiple: int, max_rows: int, growth: float = 1.25) -> tuple[int, ...]:
    """Row counts the packed update may use: ``multiple x ceil(growth ** k)`` below
    ``max_rows`` (rounded up to ``multiple``), then that top rung. The lower rungs do not
    depend on ``max_rows``, so every G shares them."""
    if multiple < 1 or growth <= 1.0:
        raise ValueError(
            f"row_ladder needs multiple >= 1 and growth > 1 (got {multiple}, {growth})"
        )
    top = max(multiple, -(-max_rows // multiple) * multiple)
    rungs, k = set(), 0
    while (rung := multiple * math.ceil(growth**k - 1e-9)) < top:
        rungs.add(rung)
        k += 1
    return tuple(sorted(rungs | {top}))


def _extents(prompt_lens_b, mask_bl, trained_b=None) -> tuple[np.ndarray, np.ndarray]:
    """(completion tokens kept [B], segment lengths [B]): up to the last unmasked completion
    token; 0 for a rollout with nothing to score or not trained (it is left out)."""
    mask_bl = np.asarray(mask_bl)
    prompt_lens_b = np.asarray(prompt_lens_b, np.int64)
    chex.assert_rank(mask_bl, 2)
    chex.assert_shape(prompt_lens_b, mask_bl.shape[:1])
    live_bl = (mask_bl != 0) & _trained(trained_b, len(mask_bl))[:, None]
    kept_b = np.where(live_bl.any(axis=1), mask_bl.shape[1] - np.argmax(live_bl[:, ::-1], 1), 0)
    if np.any((prompt_lens_b < 1) & (kept_b > 0)):
        raise ValueError("packing needs at least one prompt token per rollout (prompt_lens >= 1)")
    return kept_b, np.where(kept_b > 0, prompt_lens_b + kept_b, 0)


def _first_fit_decreasing(sizes_b: np.ndarray, pack_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(row [B], offset [B]) of every item of size > 0 (-1 for the empty ones): longest first,
    equal sizes in index order, each into the first row with room. Rows used form a prefix."""
    if np.any(sizes_b > pack_len):
        b = int(np.argmax(sizes_b))
        raise ValueError(
            f"rollout {b} has {int(sizes_b[b])} tokens, more than pack_len = {pack_len}; raise "
            f"train.pack_len"
        )
    row_b = np.full(len(sizes_b), -1, np.int64)
    offset_b = np.zeros(len(sizes_b), np.int64)
    free_r = np.full(max(1, int(np.count_nonzero(sizes_b))), pack_len, np.int64)
    for b in np.lexsort((np.arange(len(sizes_b)), -sizes_b)):  # size descending, then index
        if sizes_b[b] == 0:
            break
        r = int(np.argmax(free_r >= sizes_b[b]))  # one always fits: there are as many rows
        row_b[b], offset_b[b] = r, pack_len - free_r[r]
        free_r[r] -= sizes_b[b]
    return row_b, offset_b


def rung_for(used: int, multiple: int, max_rows: int) -> int:
    """The smallest rung of ``row_ladder(multiple, max_rows)`` of at least ``used`` rows."""
    return next(r for r in row_ladder(multiple, max_rows) if r >= used)


def packed_rows_needed(
    prompt_lens_b, mask_bl, *, pack_len: int, multiple: int, max_rows: int, trained_b=None
) -> int:
    """The smallest rung of ``row_ladder(multiple, max_rows)`` that holds this process's
    trained rollouts. Multi-process runs take the max over processes and pack every process
    into it.

    prompt_lens_b: int [B] real prompt tokens; mask_bl: float [B, L] the loss mask (1 on scored
    completion tokens, as ``rl.completion_mask``); max_rows: the padded row count (B);
    trained_b: bool [B] the rollouts trained (None: all).
    """
    _, sizes_b = _extents(prompt_lens_b, mask_bl, trained_b)
    row_b, _ = _first_fit_decreasing(sizes_b, pack_len)
    used = int(row_b.max()) + 1 if len(row_b) else 0
    return rung_for(used, multiple, max_rows)


def pack_update_batch(
    prompt_ids_bp,
    prompt_lens_b,
    completion_bl,
    old_logp_bl,
    adv_b,
    mask_bl,
    *,
    aggregation: str,
    max_new_tokens: int,
    pack_len: int,
    rows: int,
    trained_b=None,
    rollout_b=None,
) -> dict[str, np.ndarray]:
    """This process's trained rollouts packed into ``rows`` rows of ``pack_len`` tokens
    (``PACKED_KEYS``).

    prompt_ids_bp: int [B, P] left-padded prompts (row b's prompt in its last prompt_lens_b[b]
    columns); completion_bl: int [B, L]; old_logp_bl: float [B, L] rollout-time log-probs;
    adv_b: float [B]; mask_bl: float [B, L] loss mask; trained_b: bool [B] the rollouts placed
    (None: all; the others count in the normaliser only); rollout_b: int [B] their ids, unique
    in the step over every process (None: 0..B-1). ``rows`` comes from ``packed_rows_needed``
    (the max over processes); fewer rows than the packing needs raise.
    Deterministic: the same inputs give the same arrays.
    """
    share_b = normalizer_shares(mask_bl, aggregation, max_new_tokens)
    prompt_ids_bp = np.asarray(prompt_ids_bp)
    prompt_lens_b = np.asarray(prompt_lens_b, np.int64)
    mask_bl = np.asarray(mask_bl, np.float32)
    # one row per rollout everywhere, one column per completion token in the [B, L] arrays:
    # numpy would broadcast a [B, 1] advantage or slice a wider log-prob array without an error
    chex.assert_rank(prompt_ids_bp, 2)
    chex.assert_equal_shape([completion_bl, old_logp_bl, mask_bl])
    chex.assert_shape(adv_b, mask_bl.shape[:1])
    chex.assert_equal_shape([prompt_ids_bp, mask_bl], dims=0)
    kept_b, sizes_b = _extents(prompt_lens_b, mask_bl, trained_b)
    row_b, offset_b = _first_fit_decreasing(sizes_b, pack_len)
    used = int(row_b.max()) + 1 if len(row_b) else 0
    if used > rows:
        raise ValueError(f"the rollouts need {used} packed rows but rows = {rows}")
    shape = (rows, pack_len)
    rollout_b = _rollout_ids(rollout_b, len(mask_bl))
    out = {k: np.zeros(shape, np.int32) for k in ("tokens", "positions", "segment_ids", "rollout")}
    out.update({k: np.zeros(shape, np.float32) for k in ("mask", "weight", "old_logp", "adv")})
    norm_r = np.zeros(rows, np.float64)
    p = prompt_ids_bp.shape[1]
    segments_r = np.zeros(rows, np.int32)
    placed = np.flatnonzero(sizes_b)
    for b in placed[np.lexsort((offset_b[placed], row_b[placed]))]:  # ids grow along a row
        r, start, pl, n = row_b[b], offset_b[b], prompt_lens_b[b], kept_b[b]
        cols = slice(start, start + sizes_b[b])
        segments_r[r] += 1
        out["tokens"][r, cols] = np.concatenate([prompt_ids_bp[b, p - pl :], completion_bl[b, :n]])
        out["positions"][r, cols] = np.arange(sizes_b[b])
        out["segment_ids"][r, cols] = segments_r[r]
        out["rollout"][r, cols] = rollout_b[b]
        # completion token j is predicted at the position of the token before it
        scored = slice(start + pl - 1, start + pl - 1 + n)
        m = mask_bl[b, :n]
        out["mask"][r, scored] = m
        out["old_logp"][r, scored] = old_logp_bl[b, :n]
        out["adv"][r, scored] = adv_b[b]
        out["weight"][r, scored] = token_weights(m, aggregation)
    # each placed rollout's share in its row, the others' (left out, or nothing to score) in row 0
    np.add.at(norm_r, np.where(sizes_b > 0, row_b, 0), share_b)
    out["norm"] = norm_r.astype(np.float32)
    return out


def padded_update_batch(
    prompt_ids_bp,
    prompt_lens_b,
    completion_bl,
    old_logp_bl,
    adv_b,
    mask_bl,
    *,
    aggregation: str,
    max_new_tokens: int,
    rows: int,
    trained_b=None,
    rollout_b=None,
) -> dict[str, np.ndarray]:
    """This process's trained rollouts, one padded row each, in ``rows`` rows (``PADDED_KEYS``;
    the inputs as :func:`pack_update_batch`'s). Rows past the trained rollouts are empty (mask
    0, norm 0, rollout 0); row 0's ``norm`` also carries the left-out rollouts' shares."""
    arrays = {
        "prompt_ids": np.asarray(prompt_ids_bp, np.int32),
        "prompt_lens": np.asarray(prompt_lens_b, np.int32),
        "completion": np.asarray(completion_bl, np.int32),
        "old_logp": np.asarray(old_logp_bl, np.float32),
        "mask": np.asarray(mask_bl, np.float32),
        "adv": np.asarray(adv_b, np.float32),
    }
    arrays["rollout"] = _rollout_ids(rollout_b, len(arrays["adv"]))
    chex.assert_equal_shape([arrays["completion"], arrays["old_logp"], arrays["mask"]])
    chex.assert_equal_shape(list(arrays.values()), dims=0)
    share_b = normalizer_shares(mask_bl, aggregation, max_new_tokens)
    trained_b = _trained(trained_b, len(share_b))
    kept = np.flatnonzero(trained_b)
    if len(kept) > rows:
        raise ValueError(f"{len(kept)} rollouts are trained but rows = {rows}")
    out = {}
    for k, x in arrays.items():
        out[k] = np.zeros((rows, *x.shape[1:]), x.dtype)
        out[k][: len(kept)] = x[kept]
    norm_r = np.zeros(rows, np.float64)
    norm_r[: len(kept)] = share_b[kept]
    norm_r[0] += share_b[~trained_b].sum()
    out["norm"] = norm_r.astype(np.float32)
    return out
