"""Log-probabilities of the taken tokens without the whole [tokens, vocabulary] logits.

``token_logprobs(logits_fn, h_btd, targets_bt, temperature, chunk)`` is
``log_softmax(logits_fn(h) / temperature)[target]``. With ``chunk`` > 0 it runs over chunks of
about ``chunk`` tokens (all B rows, ``ceil(chunk / B)`` positions of each: the rows keep their
split over the mesh's batch axes), each chunk's float32 logits reduced to its ``logsumexp`` and
its taken logit at once, the chunk under ``jax.checkpoint``: the backward pass recomputes a
chunk's logits instead of keeping them, so neither pass holds more than one chunk of
``[tokens, V]`` floats (the forward's, and in the backward its recomputation and its
gradient). Same values and gradients as the whole-vocabulary formula, up to float32 rounding.

Model-free: ``logits_fn`` maps hidden states [B, T', D] to float32 logits [B, T', V] (the
decoder's final norm and output projection, ``Decoder.logits``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _taken_logprobs(logits_fn, h_btd, targets_bt, temperature):
    logits_btv = logits_fn(h_btd).astype(jnp.float32) / temperature
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    taken_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return taken_bt - lse_bt


def chunk_positions(rows: int, length: int, chunk: int) -> int:
    """Positions per chunk of ``token_logprobs`` for ``rows`` x ``length`` tokens: ``length``
    (one chunk: the whole vocabulary at once) when ``chunk`` is 0 or holds every token."""
    if chunk <= 0 or chunk >= rows * length:
        return length
    return max(1, min(length, chunk // max(rows, 1)))


def token_logprobs(logits_fn, h_btd, targets_bt, temperature=1.0, chunk: int = 0):
    """float32 [B, T]: ``log_softmax(logits_fn(h_btd) / temperature)`` at ``targets_bt``.

    h_btd: [B, T, D] hidden states; targets_bt: int [B, T] the token scored at each position;
    chunk: tokens per chunk (0: the whole [B, T, V] logits at once).
    """
    b, t, d = h_btd.shape
    tc = chunk_positions(b, t, chunk)
    if tc >= t:
        return _taken_logprobs(logits_fn, h_btd, targets_bt, temperature)
    n = math.ceil(t / tc)
    pad = n * tc - t  # the last chunk is padded (its extra positions' results are dropped)
    h_nbcd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, tc, d).swapaxes(0, 1)
    tgt_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, tc).swapaxes(0, 1)

    @jax.checkpoint  # the backward recomputes the chunk's logits: nothing [tc, V] is kept
    def one_chunk(args):
        h_bcd, tgt_bc = args
        return _taken_logprobs(logits_fn, h_bcd, tgt_bc, temperature)

    out_nbc = jax.lax.map(one_chunk, (h_nbcd, tgt_nbc))
    return out_nbc.swapaxes(0, 1).reshape(b, n * tc)[:, :t]
