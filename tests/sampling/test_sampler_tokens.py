"""The sampler's tokens pinned (tiny preset, weights from nnx.Rngs(0), 12 new tokens), so any
rewrite of the decode loop must draw exactly these tokens for these keys and settings.

The greedy tokens (seed 4) are the ones recorded from the sampler before the per-step changes of
issue #20 (commit 3c05717): every sampler since has decoded them. The sampled ones were recorded
again with issue #31, whose random stream is per rollout (token t of rollout r draws with
fold_in(fold_in(key, r), t), whatever the slots or row buckets);
tests/sampling/test_sampler_engine.py checks that the stream draws from the policy's distribution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.models import Decoder, get_preset
from sagc_jax.sampling import Sampler, left_pad
from sagc_jax.sampling.functions import first_argmax

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [300, 301, 302, 303, 4]]
MAX_NEW = 12

# (seed, settings) -> (tokens [B, L], sum over L of each row's logprobs [B]), no end tokens.
PINNED = {
    (0, (1.0, 1.0, 0)): (
        [
            [108, 50, 113, 333, 454, 431, 99, 76, 151, 174, 168, 460],
            [285, 47, 394, 480, 423, 418, 33, 4, 352, 428, 346, 407],
            [26, 397, 381, 284, 289, 445, 300, 482, 66, 482, 143, 91],
            [483, 438, 475, 340, 326, 276, 10, 131, 424, 3, 146, 338],
        ],
        [-69.7793, -69.5069, -66.1232, -65.6659],
    ),
    (1, (0.7, 0.9, 0)): (
        [
            [186, 473, 91, 2, 39, 447, 91, 91, 350, 13, 30, 153],
            [9, 113, 113, 28, 404, 312, 124, 9, 97, 272, 272, 12],
            [481, 481, 497, 139, 347, 470, 140, 298, 439, 193, 492, 282],
            [398, 20, 433, 477, 491, 438, 418, 474, 310, 9, 41, 258],
        ],
        [-60.9622, -56.1764, -61.3015, -57.7502],
    ),
    (2, (1.2, 1.0, 20)): (
        [
            [350, 502, 91, 171, 137, 137, 97, 12, 180, 325, 225, 334],
            [189, 300, 334, 476, 206, 133, 81, 227, 217, 133, 93, 36],
            [350, 233, 231, 211, 482, 76, 133, 199, 152, 504, 187, 350],
            [177, 87, 60, 215, 13, 305, 271, 418, 281, 392, 445, 206],
        ],
        [-55.5130, -56.2038, -57.9243, -56.7938],
    ),
    (3, (1.0, 0.5, 50)): (
        [
            [330, 91, 180, 11, 119, 473, 99, 153, 112, 26, 461, 302],
            [64, 151, 407, 176, 439, 415, 302, 99, 236, 463, 276, 165],
            [119, 379, 493, 298, 298, 148, 18, 53, 455, 53, 53, 117],
            [206, 62, 301, 377, 300, 477, 66, 66, 333, 87, 212, 87],
        ],
        [-53.4626, -54.0876, -48.3155, -51.5479],
    ),
    (4, (0.0, 1.0, 0)): (
        [
            [30, 80, 330, 11, 11, 11, 11, 11, 19, 19, 19, 19],
            [317, 164, 12, 105, 445, 407, 407, 407, 492, 104, 104, 502],
            [26, 482, 445, 445, 445, 482, 445, 482, 445, 445, 385, 345],
            [237, 13, 418, 492, 291, 291, 215, 400, 491, 491, 291, 48],
        ],
        [-40.9535, -44.6906, -44.2001, -44.5898],
    ),
}
# End tokens that some rows meet (row 2 at token 7 for seed 0, ...), not all: the loop runs on.
SOME_END = (7, 100, 200, 300, 400, 500)
SOME_END_LENGTHS = {0: [12, 12, 7, 12], 1: [12, 12, 12, 12], 2: [12, 2, 12, 12]}
SOME_END_LENGTHS |= {3: [12, 12, 12, 5], 4: [12, 12, 12, 8]}
# Greedy (seed 4) with these end tokens: every row ends by its 5th token, the loop after 4 steps.
ALL_END = (11, 12, 445, 291)
ALL_END_LENGTHS = [4, 3, 3, 5]
ALL_END_LOGPROB_SUMS = [-15.1026, -11.5437, -10.7002, -17.7644]


@pytest.fixture(scope="module")
def model_state():
    model = Decoder(get_preset("tiny"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids_bt, lens_b = left_pad(PROMPTS, pad_id=0, buckets=(8,))
    return graphdef, model.config, state, ids_bt, lens_b


def _call(sampler, state, ids_bt, lens_b, seed, settings):
    temperature, top_p, top_k = settings
    out = sampler(
        state,
        ids_bt,
        lens_b,
        jax.random.key(seed),
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    return jax.device_get(out)


@pytest.mark.parametrize("chunk", ["auto", 4])
def test_tokens_are_the_pinned_ones(model_state, chunk):
    """One phase (auto) and three phases (chunk 4): the recorded tokens; with three phases and
    end tokens that some rows meet, the same tokens up to each row's end and padding after."""
    graphdef, cfg, state, ids_bt, lens_b = model_state
    forced = Sampler(graphdef, cfg, eos_ids=(), pad_id=0, decode_chunk=chunk)
    ending = Sampler(graphdef, cfg, eos_ids=SOME_END, pad_id=0, decode_chunk=chunk)
    for (seed, settings), (tokens, sums) in PINNED.items():
        out = _call(forced, state, ids_bt, lens_b, seed, settings)
        np.testing.assert_array_equal(out.tokens_bt, tokens, err_msg=f"seed {seed} {settings}")
        np.testing.assert_allclose(out.logprobs_bt.sum(1), sums, atol=2e-3)
        assert int(out.num_decode_steps) == MAX_NEW - 1 and out.truncated_b.all()
        if chunk == "auto":
            continue
        cut = _call(ending, state, ids_bt, lens_b, seed, settings)
        lengths_b = np.asarray(SOME_END_LENGTHS[seed])
        np.testing.assert_array_equal(cut.lengths_b, lengths_b)
        kept_bt = np.arange(MAX_NEW)[None, :] < lengths_b[:, None]
        np.testing.assert_array_equal(cut.tokens_bt, np.where(kept_bt, tokens, 0))
        np.testing.assert_allclose(
            cut.logprobs_bt, np.where(kept_bt, out.logprobs_bt, 0), atol=1e-5
        )
        assert int(cut.num_decode_steps) == MAX_NEW - 1
        np.testing.assert_array_equal(cut.truncated_b, lengths_b == MAX_NEW)


@pytest.mark.parametrize("chunk", [0, 2])
def test_early_exit_is_pinned(model_state, chunk):
    """Every row ends by step 4: the loop stops there (in the second of six phases for
    chunk 2), with the pinned greedy tokens."""
    graphdef, cfg, state, ids_bt, lens_b = model_state
    sampler = Sampler(graphdef, cfg, eos_ids=ALL_END, pad_id=0, decode_chunk=chunk)
    out = _call(sampler, state, ids_bt, lens_b, 4, (0.0, 1.0, 0))
    lengths_b = np.asarray(ALL_END_LENGTHS)
    kept_bt = np.arange(MAX_NEW)[None, :] < lengths_b[:, None]
    np.testing.assert_array_equal(out.tokens_bt, np.where(kept_bt, PINNED[4, (0.0, 1.0, 0)][0], 0))
    np.testing.assert_array_equal(out.lengths_b, lengths_b)
    np.testing.assert_allclose(out.logprobs_bt.sum(1), ALL_END_LOGPROB_SUMS, atol=2e-3)
    assert int(out.num_decode_steps) == 4 and not out.truncated_b.any()


def test_first_argmax_is_argmax():
    """Ties (the first wins), infinities, NaN (the first NaN wins) and all -inf rows."""
    rng = np.random.RandomState(0)
    x_bv = rng.randint(0, 4, (400, 7)).astype(np.float32)
    for value in (np.nan, np.inf, -np.inf):
        x_bv[rng.rand(*x_bv.shape) < 0.1] = value
    x_bv[0], x_bv[1] = -np.inf, np.nan
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x_bv)), np.argmax(x_bv, axis=-1))
    np.testing.assert_array_equal(
        first_argmax(jnp.asarray(x_bv)), jnp.argmax(jnp.asarray(x_bv), axis=-1)
    )
