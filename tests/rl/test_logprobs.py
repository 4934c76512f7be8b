"""Chunked log-probabilities (``rl.logprobs.token_logprobs``): the same values and gradients as
the whole-vocabulary ``log_softmax``, and no [tokens, vocabulary] buffer kept for the backward."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.models import Decoder, get_preset
from sagc_jax.programs.update import completion_logprobs, packed_logprobs
from sagc_jax.rl.logprobs import chunk_positions, token_logprobs

B, T, D, V = 3, 11, 16, 40  # 33 tokens: chunks of 8 (2 positions x 3 rows, 4) do not divide it


def _whole(logits_fn, h, targets, temperature):
    """The formula the chunks replace."""
    logp = jax.nn.log_softmax(logits_fn(h) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    w = jax.random.normal(k[0], (D, V)) / np.sqrt(D)
    h = jax.random.normal(k[1], (B, T, D))
    targets = jax.random.randint(k[2], (B, T), 0, V)
    weights = jax.random.normal(k[3], (B, T))
    return w, h, targets, weights


def test_chunk_positions():
    assert chunk_positions(3, 11, 0) == 11  # 0: whole
    assert chunk_positions(3, 11, 33) == 11  # a chunk that holds every token: whole
    assert chunk_positions(3, 11, 8) == 2  # 8 tokens over 3 rows: 2 positions
    assert chunk_positions(3, 11, 2) == 1  # at least one position
    assert chunk_positions(1, 2560, 1024) == 1024


@pytest.mark.parametrize("chunk", [0, 1, 8, 12, 32, 33, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_whole_vocabulary(chunk, temperature):
    w, h, targets, weights = _inputs()

    def loss(fn, w, h):
        logp = fn(lambda x: jnp.einsum("btd,dv->btv", x, w), h, targets, temperature)
        return jnp.sum(weights * logp), logp

    chunked = functools.partial(token_logprobs, chunk=chunk)
    (l_c, logp_c), g_c = jax.jit(
        jax.value_and_grad(functools.partial(loss, chunked), argnums=(0, 1), has_aux=True)
    )(w, h)
    (l_w, logp_w), g_w = jax.jit(
        jax.value_and_grad(functools.partial(loss, _whole), argnums=(0, 1), has_aux=True)
    )(w, h)
    chex.assert_shape(logp_c, (B, T))
    chex.assert_trees_all_close(logp_c, logp_w, rtol=1e-6, atol=1e-5)
    chex.assert_trees_all_close(l_c, l_w, rtol=1e-6, atol=1e-5)
    chex.assert_trees_all_close(g_c, g_w, rtol=1e-5, atol=1e-5)


def test_backward_keeps_no_vocabulary_sized_residual():
    """The chunk is under jax.checkpoint: the backward keeps its inputs, not its logits."""
    from jax._src.ad_checkpoint import saved_residuals

    w, h, targets, _ = _inputs()

    def loss(w, h, chunk):
        fn = lambda x: jnp.einsum("btd,dv->btv", x, w)  # noqa: E731
        return jnp.sum(token_logprobs(fn, h, targets, 1.0, chunk))

    def vocab_sized(chunk):
        saved = saved_residuals(functools.partial(loss, chunk=chunk), w, h)
        return [
            aval.shape for aval, _ in saved if aval.shape and aval.shape[-1] == V and aval.ndim > 2
        ]

    assert vocab_sized(0)  # the whole formula keeps [B, T, V] for its backward
    assert not vocab_sized(6)


# A decoder small enough to compile fast, with a vocabulary larger than a chunk.
TINY = get_preset(
    "tiny",
    vocab_size=48,
    num_layers=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.slow
def test_decoder_logprobs_and_gradients_equal_unchunked():
    """completion_logprobs and packed_logprobs of a tiny decoder: chunked == chunk 0, values and
    gradients, at temperature 0.8, with chunks that do not divide the tokens."""
    graphdef, params = nnx.split(Decoder(TINY, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    b, p, length = 4, 6, 7
    lens = np.array([6, 3, 1, 4], np.int32)
    prompt = np.zeros((b, p), np.int32)
    for i, k in enumerate(lens):
        prompt[i, p - k :] = rng.integers(3, 48, k)
    completion = rng.integers(3, 48, (b, length)).astype(np.int32)
    tokens = rng.integers(3, 48, (2, 13)).astype(np.int32)
    positions = np.array([list(range(6)) + list(range(7)), list(range(13))], np.int32)
    segments = np.array([[1] * 6 + [2] * 7, [1] * 13], np.int32)
    weights_padded = rng.normal(size=(b, length)).astype(np.float32)
    weights_packed = rng.normal(size=(2, 13)).astype(np.float32)

    def loss(params, chunk):
        model = nnx.merge(graphdef, params)
        padded = completion_logprobs(model, prompt, lens, completion, 0.8, chunk=chunk)
        packed = packed_logprobs(model, tokens, positions, segments, 0.8, chunk=chunk)
        value = jnp.sum(weights_padded * padded) + jnp.sum(weights_packed * packed)
        return value, (padded, packed)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l0, logp0), g0 = grad(params, 0)
    for chunk in (5, 9):  # positions a chunk: padded (4 rows) 1 and 2, packed (2 rows) 2 and 4
        (l1, logp1), g1 = grad(params, chunk)
        chex.assert_trees_all_close(logp1, logp0, rtol=1e-6, atol=1e-5)
        chex.assert_trees_all_close(l1, l0, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-5)
