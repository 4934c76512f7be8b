"""Sampler: agreement with the full forward pass, early exit, no recompiles, sampling filters."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.models import Decoder, get_preset
from sagc_jax.sampling import Sampler, bucket_length, left_pad, sample, sample_token

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]
BUCKETS = (8, 16)
MAX_NEW = 12


@pytest.fixture(scope="module")
def setup():
    cfg = get_preset("tiny")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    sampler, state = Sampler.from_model(model, eos_ids=(), pad_id=0)
    ids_bt, lens_b = left_pad(PROMPTS, pad_id=0, buckets=BUCKETS)
    greedy = sampler(
        state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=MAX_NEW, temperature=0
    )
    return model, sampler, state, ids_bt, lens_b, jax.device_get(greedy)


@nnx.jit
def _logprobs(model, tokens_bt, temperature):
    return jax.nn.log_softmax(model(tokens_bt) / temperature, axis=-1)


def _policy_logprobs(model, prompt, completion, temperature):
    """log p(completion[i] | prompt, completion[:i]) from one unpadded full forward pass."""
    seq_t = np.asarray(list(prompt) + list(completion), np.int32)
    logprobs_tv = _logprobs(model, jnp.asarray(seq_t[None]), temperature)[0]
    rows = np.arange(len(prompt) - 1, len(seq_t) - 1)
    return np.asarray(logprobs_tv)[rows, seq_t[rows + 1]], np.asarray(logprobs_tv)[rows]


def test_left_pad_rounds_up_to_bucket():
    ids_bt, lens_b = left_pad(PROMPTS, pad_id=0, buckets=BUCKETS)
    assert ids_bt.shape == (3, 8) and ids_bt.dtype == np.int32
    np.testing.assert_array_equal(lens_b, [3, 7, 1])
    np.testing.assert_array_equal(ids_bt[0], [0, 0, 0, 0, 0, 5, 6, 7])
    assert bucket_length(9, BUCKETS) == 16 and bucket_length(64) == 64
    with pytest.raises(ValueError, match="largest bucket 16"):
        left_pad([list(range(17))], pad_id=0, buckets=BUCKETS)


def test_prompt_lengths_are_checked_against_the_bucket(setup):
    _, sampler, state, ids_bt, _, _ = setup
    with pytest.raises(ValueError, match=r"values in \[1, 8\]"):
        sampler(state, ids_bt, [3, 9, 1], jax.random.key(0), max_new_tokens=MAX_NEW)


def test_greedy_follows_the_full_forward_argmax_with_its_logprobs(setup):
    model, _, _, _, _, out = setup
    assert out.tokens_bt.shape == (3, MAX_NEW) and out.tokens_bt.dtype == np.int32
    np.testing.assert_array_equal(out.lengths_b, MAX_NEW)
    assert out.truncated_b.all() and int(out.num_decode_steps) == MAX_NEW - 1
    for row, prompt in enumerate(PROMPTS):
        completion = out.tokens_bt[row]
        want_lp, logprobs_tv = _policy_logprobs(model, prompt, completion, 1.0)
        np.testing.assert_array_equal(completion, logprobs_tv.argmax(-1))
        np.testing.assert_allclose(out.logprobs_bt[row], want_lp, atol=1e-4)


def test_sampled_logprobs_are_the_tempered_policy(setup):
    model, sampler, state, ids_bt, lens_b, greedy = setup
    out = sampler(state, ids_bt, lens_b, jax.random.key(3), max_new_tokens=MAX_NEW, temperature=0.7)
    assert not np.array_equal(out.tokens_bt, greedy.tokens_bt)
    for row, prompt in enumerate(PROMPTS):
        want_lp, _ = _policy_logprobs(model, prompt, out.tokens_bt[row], 0.7)
        np.testing.assert_allclose(out.logprobs_bt[row], want_lp, atol=1e-4)


def test_stops_early_when_every_row_has_ended(setup):
    _, sampler, state, ids_bt, lens_b, greedy = setup
    tokens_bt = greedy.tokens_bt
    # End-of-sequence tokens that greedy decoding reaches early in every row.
    eos_ids = (int(tokens_bt[0, 2]), int(tokens_bt[1, 1]), int(tokens_bt[2, 3]))
    is_eos_bt = np.isin(tokens_bt, eos_ids)
    want_lengths_b = is_eos_bt.argmax(axis=1) + 1
    assert want_lengths_b.max() <= 4
    stopping = Sampler(sampler.graphdef, sampler.config, eos_ids=eos_ids, pad_id=0)
    out = stopping(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=MAX_NEW, temperature=0)
    np.testing.assert_array_equal(out.lengths_b, want_lengths_b)
    assert not out.truncated_b.any()
    # Fewer decode iterations than the MAX_NEW - 1 of the run without end tokens.
    assert int(out.num_decode_steps) == want_lengths_b.max() - 1 < int(greedy.num_decode_steps)
    for row, n in enumerate(want_lengths_b):
        np.testing.assert_array_equal(out.tokens_bt[row, :n], tokens_bt[row, :n])
        assert (out.tokens_bt[row, n:] == 0).all() and (out.logprobs_bt[row, n:] == 0).all()


def test_new_prompts_seeds_and_settings_do_not_recompile(setup):
    _, sampler, state, _, _, _ = setup
    programs, traces = sampler.compiled_programs(), sampler.num_traces
    assert programs >= 1
    calls = [
        (PROMPTS, 0, dict(temperature=1.0)),
        ([[1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]], 1, dict(temperature=0.5, top_p=0.9)),
        ([[4], [5], [6, 7]], 2, dict(temperature=0.0, top_k=5)),
        (PROMPTS, 3, dict(temperature=1.3, top_p=0.5, top_k=50)),
    ]
    for prompts, seed, settings in calls:
        ids_bt, lens_b = left_pad(prompts, pad_id=0, buckets=BUCKETS)
        out = sampler(
            state, ids_bt, lens_b, jax.random.key(seed), max_new_tokens=MAX_NEW, **settings
        )
        jax.block_until_ready(out)
    assert (sampler.compiled_programs(), sampler.num_traces) == (programs, traces)
    # A new (batch, bucket, max_new_tokens) shape compiles one more program.
    ids_bt, lens_b = left_pad([list(range(1, 12))], pad_id=0, buckets=BUCKETS)
    sampler(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=4)
    assert (sampler.compiled_programs(), sampler.num_traces) == (programs + 1, traces + 1)


def test_same_key_same_output_and_kept_cache_does_not_leak(setup):
    _, sampler, state, ids_bt, lens_b, greedy = setup
    first = sampler(state, ids_bt, lens_b, jax.random.key(7), max_new_tokens=MAX_NEW)
    other_ids_bt, other_lens_b = left_pad([[99] * 8, [98] * 8, [97] * 8], 0, BUCKETS)
    sampler(state, other_ids_bt, other_lens_b, jax.random.key(8), max_new_tokens=MAX_NEW)
    again = sampler(state, ids_bt, lens_b, jax.random.key(7), max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(first.tokens_bt, again.tokens_bt)
    np.testing.assert_array_equal(first.logprobs_bt, again.logprobs_bt)
    # The convenience function agrees with the Sampler.
    model = nnx.merge(sampler.graphdef, state)
    out = sample(
        model,
        ids_bt,
        lens_b,
        jax.random.key(0),
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_ids=(),
    )
    np.testing.assert_array_equal(out.tokens_bt, greedy.tokens_bt)


# ---------------------------------------------------------------------- sample_token
LOGITS_V = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
NUM_DRAWS = 4000


@jax.jit
def _frequencies(temperature, top_p, top_k):
    keys = jax.random.split(jax.random.key(0), NUM_DRAWS)
    logits_bv = jnp.broadcast_to(jnp.asarray(LOGITS_V), (1, LOGITS_V.size))

    def one(key):
        return sample_token(logits_bv, key, temperature, top_p, top_k)[0][0]

    tokens = jax.vmap(one)(keys)
    return jnp.bincount(tokens, length=LOGITS_V.size) / NUM_DRAWS


def _settings(temperature=1.0, top_p=1.0, top_k=0):
    return jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k)


@pytest.mark.parametrize(
    "settings, want",
    [
        (dict(), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
        (dict(temperature=0.0), [1, 0, 0, 0, 0, 0]),
        (dict(top_k=1), [1, 0, 0, 0, 0, 0]),
        (dict(top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
        # Nucleus 0.7: 0.4 + 0.25 = 0.65 < 0.7, so the third token (0.15) is needed too.
        (dict(top_p=0.7), [0.5, 0.3125, 0.1875, 0, 0, 0]),
        (dict(top_p=0.3), [1, 0, 0, 0, 0, 0]),
        (dict(top_p=0.9, top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
    ],
)
def test_sampling_distribution(settings, want):
    freq = np.asarray(_frequencies(*_settings(**settings)))
    np.testing.assert_allclose(freq, want, atol=0.03)
    assert (freq[np.asarray(want) == 0] == 0).all()


def test_temperature_sharpens_and_flattens():
    probs = np.exp(LOGITS_V / 0.5) / np.exp(LOGITS_V / 0.5).sum()
    np.testing.assert_allclose(_frequencies(*_settings(temperature=0.5)), probs, atol=0.03)
    flat = np.exp(LOGITS_V / 3.0) / np.exp(LOGITS_V / 3.0).sum()
    np.testing.assert_allclose(_frequencies(*_settings(temperature=3.0)), flat, atol=0.03)


def test_logprob_is_untruncated_tempered_log_softmax():
    logits_bv = jnp.asarray(LOGITS_V)[None]
    token_b, logprob_b = sample_token(logits_bv, jax.random.key(1), *_settings(0.5, 0.3, 1))
    assert int(token_b[0]) == 0
    want = jax.nn.log_softmax(logits_bv / 0.5)[0, 0]
    np.testing.assert_allclose(logprob_b[0], want, rtol=1e-6)


_SHARDED_SCRIPT = """
import jax, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from sagc_jax.models import Decoder, get_preset
from sagc_jax.sampling import Sampler, left_pad
assert jax.device_count() == 2
small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
model = Decoder(get_preset("tiny", **small), rngs=nnx.Rngs(0))
ids_bt, lens_b = left_pad([[5, 6, 7], [8, 9], [20], [4, 4, 4, 4]], pad_id=0, buckets=(8,))
plain, state = Sampler.from_model(model, eos_ids=(), pad_id=0)
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("data"))
sharded = Sampler(plain.graphdef, plain.config, eos_ids=(), batch_sharding=rows)
a, b = (s(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=6, temperature=0.0)
        for s in (plain, sharded))
assert b.tokens_bt.sharding.spec == P("data"), b.tokens_bt.sharding
np.testing.assert_array_equal(a.tokens_bt, b.tokens_bt)
np.testing.assert_allclose(a.logprobs_bt, b.logprobs_bt, atol=1e-5)
# Rows 0-1 (device 0) end at their first token; the step count is the slowest device's.
first = np.asarray(a.tokens_bt[:, 0])
stop = Sampler(plain.graphdef, plain.config, eos_ids=tuple(first[:2]), batch_sharding=rows)
c = stop(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=6, temperature=0.0)
assert list(np.asarray(c.lengths_b)[:2]) == [1, 1], c.lengths_b
assert int(c.num_decode_steps) == int(np.max(c.lengths_b)) - 1
print("OK")
"""


def test_batch_sharded_over_two_host_devices_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
