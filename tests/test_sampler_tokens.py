"""The sampler's tokens pinned: recorded from the sampler before the per-step changes of issue #20
(commit 3c05717), so any rewrite of the decode loop must draw exactly these tokens for these
keys and settings (tiny preset, weights from nnx.Rngs(0), 12 new tokens)."""

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
            [411, 5, 468, 149, 80, 373, 442, 246, 144, 269, 210, 236],
            [81, 12, 460, 380, 385, 319, 83, 40, 29, 184, 183, 234],
            [113, 300, 178, 490, 40, 450, 306, 67, 385, 70, 467, 250],
            [66, 210, 119, 121, 239, 469, 344, 251, 1, 136, 124, 464],
        ],
        [-72.5205, -69.5684, -66.3452, -70.3463],
    ),
    (1, (0.7, 0.9, 0)): (
        [
            [305, 189, 226, 68, 334, 18, 396, 396, 334, 322, 490, 341],
            [105, 280, 72, 164, 191, 269, 473, 438, 159, 312, 294, 234],
            [400, 119, 379, 139, 167, 129, 403, 146, 467, 326, 21, 440],
            [92, 97, 325, 17, 60, 357, 62, 311, 258, 57, 209, 491],
        ],
        [-60.7827, -64.3892, -63.0953, -61.8121],
    ),
    (2, (1.2, 1.0, 20)): (
        [
            [153, 502, 331, 102, 39, 243, 11, 396, 105, 350, 136, 449],
            [261, 217, 18, 252, 133, 261, 443, 339, 83, 66, 319, 457],
            [26, 21, 144, 369, 352, 281, 231, 504, 376, 495, 455, 425],
            [377, 476, 152, 62, 62, 16, 104, 406, 279, 185, 300, 87],
        ],
        [-56.7519, -57.6351, -55.5378, -55.1911],
    ),
    (3, (1.0, 0.5, 50)): (
        [
            [11, 11, 67, 136, 445, 176, 63, 105, 511, 101, 63, 63],
            [48, 300, 73, 476, 483, 242, 503, 207, 217, 392, 392, 263],
            [119, 277, 493, 76, 243, 364, 493, 481, 481, 473, 191, 191],
            [87, 318, 396, 462, 62, 476, 472, 472, 472, 62, 291, 423],
        ],
        [-49.8630, -52.6579, -48.7139, -54.4106],
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
# End tokens that some rows meet (row 2 at token 2 for seed 0, ...), not all: the loop runs on.
SOME_END = (7, 100, 200, 300, 400, 500)
SOME_END_LENGTHS = {0: [12, 12, 2, 12], 1: [12, 12, 1, 12], 2: [12, 12, 12, 11]}
SOME_END_LENGTHS |= {3: [12, 2, 12, 12], 4: [12, 12, 12, 8]}
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
