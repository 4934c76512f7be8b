"""Sampler: agreement with the full forward pass, early exit, no recompiles, sampling filters."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.config import ConfigError, load_config
from sagc_jax.models import Decoder, get_preset
from sagc_jax.sampling import Sampler, bucket_length, left_pad, sample_token
from sagc_jax.sampling.sampler import phase_slots, resolve_chunk

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]
BUCKETS = (8, 16)
MAX_NEW = 12


@pytest.fixture(scope="module")
def setup():
    cfg = get_preset("tiny")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    sampler = Sampler(graphdef, cfg, eos_ids=(), pad_id=0)
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


def test_same_key_same_output_whatever_ran_before(setup):
    _, sampler, state, ids_bt, lens_b, greedy = setup
    first = sampler(state, ids_bt, lens_b, jax.random.key(7), max_new_tokens=MAX_NEW)
    other_ids_bt, other_lens_b = left_pad([[99] * 8, [98] * 8, [97] * 8], 0, BUCKETS)
    sampler(state, other_ids_bt, other_lens_b, jax.random.key(8), max_new_tokens=MAX_NEW)
    again = sampler(state, ids_bt, lens_b, jax.random.key(7), max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(first.tokens_bt, again.tokens_bt)
    np.testing.assert_array_equal(first.logprobs_bt, again.logprobs_bt)


# ---------------------------------------------------------------------- decode phases
def test_phase_slots_and_chunk():
    assert phase_slots(12, 0) == (12,)
    assert phase_slots(12, 4) == (4, 8, 12)  # steps 1-4, 5-8, 9-11
    assert phase_slots(12, 5) == (5, 10, 12)
    assert phase_slots(11, 5) == (5, 10)  # step 10 is the last: 10 slots are enough
    assert phase_slots(12, 11) == phase_slots(12, 40) == (12,)
    assert phase_slots(1, 3) == (1,)
    assert phase_slots(256, 32) == tuple(range(32, 257, 32))
    assert resolve_chunk(12) == 32 and resolve_chunk(256) == 32 and resolve_chunk(1000) == 125
    assert resolve_chunk(12, 0) == 0
    for bad in (-1, "half", 2.5):
        with pytest.raises(ValueError, match="decode_chunk"):
            resolve_chunk(12, bad)
    assert load_config(None, []).sampling.decode_chunk == "auto"
    assert load_config(None, ["sampling.decode_chunk=16"]).sampling.decode_chunk == 16
    for bad in ("-1", "half"):
        with pytest.raises(ConfigError, match="sampling.decode_chunk"):
            load_config(None, [f"sampling.decode_chunk={bad}"])


def _eos_for(tokens_bt, cuts):
    """End tokens taken from row r at position cuts[r] (None: none from that row), and the
    lengths they give each row of `tokens_bt` (MAX_NEW where a row never meets one)."""
    eos_ids = tuple(int(tokens_bt[r, c]) for r, c in enumerate(cuts) if c is not None)
    is_eos_bt = np.isin(tokens_bt, eos_ids)
    lengths_b = np.where(is_eos_bt.any(1), is_eos_bt.argmax(1) + 1, tokens_bt.shape[1])
    return eos_ids, lengths_b


@pytest.fixture(scope="module")
def single_phase(setup):
    """Reference outputs of the single-phase sampler (decode_chunk=0) for two sets of end
    tokens: rows ending in different phases (one never), and every row ending early."""
    _, sampler, state, ids_bt, lens_b, greedy = setup
    mixed, mixed_lengths_b = _eos_for(greedy.tokens_bt, (1, 5, None))
    early, early_lengths_b = _eos_for(greedy.tokens_bt, (2, 1, 3))
    assert len(set(mixed_lengths_b.tolist())) == 3 and max(early_lengths_b) <= 4
    refs = {}
    for eos_ids in (mixed, early):
        ref = Sampler(sampler.graphdef, sampler.config, eos_ids=eos_ids, decode_chunk=0)
        refs[eos_ids] = [
            jax.device_get(ref(state, ids_bt, lens_b, jax.random.key(seed), **settings))
            for seed, settings in PHASE_CALLS
        ]
    return mixed, early, refs


PHASE_CALLS = [
    (0, dict(max_new_tokens=MAX_NEW, temperature=0.0)),
    (1, dict(max_new_tokens=MAX_NEW, temperature=0.9)),
    (2, dict(max_new_tokens=MAX_NEW, temperature=1.0, top_k=40)),
]


def _assert_same_samples(out, want):
    np.testing.assert_array_equal(out.tokens_bt, want.tokens_bt)
    np.testing.assert_array_equal(out.lengths_b, want.lengths_b)
    np.testing.assert_array_equal(out.truncated_b, want.truncated_b)
    assert int(out.num_decode_steps) == int(want.num_decode_steps)
    np.testing.assert_allclose(out.logprobs_bt, want.logprobs_bt, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 5])
def test_decode_phases_give_the_single_phase_tokens(setup, single_phase, chunk):
    """Phases of `chunk` slots (4 divides MAX_NEW, 5 does not) sample what one
    phase over the whole cache does, greedy or not, with rows ending in different phases (or
    never); one program for all the calls."""
    _, sampler, state, ids_bt, lens_b, greedy = setup
    mixed, _, refs = single_phase
    phased = Sampler(sampler.graphdef, sampler.config, eos_ids=mixed, decode_chunk=chunk)
    for (seed, settings), want in zip(PHASE_CALLS, refs[mixed], strict=True):
        out = phased(state, ids_bt, lens_b, jax.random.key(seed), **settings)
        _assert_same_samples(jax.device_get(out), want)
    greedy_mixed = refs[mixed][0]
    assert greedy_mixed.truncated_b.tolist() == [False, False, True]
    assert int(greedy_mixed.num_decode_steps) == MAX_NEW - 1
    assert phased.compiled_programs() == 1


def test_decode_phases_stop_when_every_row_is_done(setup, single_phase):
    """Every row ends by step 3, in the second of six phases: the other four are skipped."""
    _, sampler, state, ids_bt, lens_b, _ = setup
    _, early, refs = single_phase
    phased = Sampler(sampler.graphdef, sampler.config, eos_ids=early, decode_chunk=2)
    (seed, settings), want = PHASE_CALLS[0], refs[early][0]
    out = jax.device_get(phased(state, ids_bt, lens_b, jax.random.key(seed), **settings))
    _assert_same_samples(out, want)
    assert not out.truncated_b.any()
    assert int(out.num_decode_steps) == int(out.lengths_b.max()) - 1 <= 3


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
import logging
import jax, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from sagc_jax.config import MeshConfig
from sagc_jax.models import Decoder, get_preset
from sagc_jax.parallel import ShardingPlan, bytes_per_device
from sagc_jax import decode_schedule
from sagc_jax.sampling import Sampler, left_pad
assert jax.device_count() == 2
small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
model = Decoder(get_preset("tiny", **small), rngs=nnx.Rngs(0))
ids_bt, lens_b = left_pad([[5, 6, 7], [8, 9], [20], [4, 4, 4, 4]], pad_id=0, buckets=(8,))
graphdef, state = nnx.split(model)
plain = Sampler(graphdef, model.config, eos_ids=(), pad_id=0, decode_chunk=0)
compiles = []  # XLA compiles of the sampler program
handler = logging.Handler()
handler.emit = lambda r: "_generate_impl" in r.getMessage() and compiles.append(r.getMessage())
logging.getLogger("jax").addHandler(handler)
def run(sampler, params, **kw):
    out = sampler(params, ids_bt, lens_b, jax.random.key(0), max_new_tokens=6, **kw)
    return out, sampler.to_host(out)
for mesh in (MeshConfig(data=2, fsdp=1), MeshConfig(data=1, fsdp=2)):
    plan = ShardingPlan.from_config(mesh)
    param_sh = plan.params(state)
    params = jax.device_put(state, param_sh)
    sharded = Sampler(plain.graphdef, plain.config, eos_ids=(), decode_chunk=3, plan=plan,
                      state_shardings=param_sh)
    sharded.compile(params, *ids_bt.shape, max_new_tokens=6)  # the calls run this executable
    for temperature in (0.0, 1.0):
        _, a = run(plain, state, temperature=temperature)
        compiles.clear()
        with jax.log_compiles():
            out, b = run(sharded, params, temperature=temperature)
        assert not compiles, compiles
        assert out.tokens_bt.sharding.spec == P(("data", "fsdp")), out.tokens_bt.sharding
        np.testing.assert_array_equal(a.tokens_bt, b.tokens_bt)
        np.testing.assert_allclose(a.logprobs_bt, b.logprobs_bt, atol=1e-5)
    assert sharded.compiled_programs() == 1
    # The cache the program starts from is split by rows (its per-row index too).
    one = bytes_per_device(plain.empty_cache(4, 10))
    assert bytes_per_device(sharded.empty_cache(4, 10)) * 2 == one, one
# Rows 0-1 end at their first token, rows 2-3 later: early exit follows the slowest row.
_, a = run(plain, state, temperature=0.0)
stop = Sampler(plain.graphdef, plain.config, eos_ids=tuple(a.tokens_bt[:2, 0]), decode_chunk=3,
               plan=plan, state_shardings=param_sh)
_, c = run(stop, params, temperature=0.0)
assert list(c.lengths_b[:2]) == [1, 1], c.lengths_b
assert int(c.num_decode_steps) == int(np.max(c.lengths_b)) - 1
# 8 rollouts of the 4 prompts (prompt_index_r) through 4 slots, 2 per device, rows leaving for
# rung 2 as they end: the one-device sampler's tokens, and the schedule's counters.
index_r = np.array([3, 0, 1, 2, 2, 1, 0, 3])
_, greedy = run(plain, state, temperature=0.0, prompt_index_r=index_r)
_, free = run(plain, state, temperature=1.0, prompt_index_r=index_r)
ends = (int(greedy.tokens_bt[1, 1]), int(greedy.tokens_bt[2, 0]))
ends += (int(free.tokens_bt[0, 3]), int(free.tokens_bt[2, 1]))
one = Sampler(plain.graphdef, plain.config, eos_ids=ends, decode_chunk=0)
streamed = Sampler(plain.graphdef, plain.config, eos_ids=ends, decode_chunk=3, slots=4,
                   row_buckets=2, plan=plan, state_shardings=param_sh)
assert streamed.slots_for(8) == 4 and plan.batch_shards == 2
for temperature in (0.0, 1.0):
    _, a = run(one, state, temperature=temperature, prompt_index_r=index_r)
    _, b = run(streamed, params, temperature=temperature, prompt_index_r=index_r)
    np.testing.assert_array_equal(a.tokens_bt, b.tokens_bt)
    np.testing.assert_array_equal(a.lengths_b, b.lengths_b)
    np.testing.assert_array_equal(a.truncated_b, b.truncated_b)
    np.testing.assert_allclose(a.logprobs_bt, b.logprobs_bt, atol=1e-5)
    want = decode_schedule.simulate(b.lengths_b, 6, slots=4, chunk=3, row_buckets=2, shards=2)
    counted = (int(b.num_decode_steps), int(b.rows_decoded), int(b.live_rows_decoded))
    assert counted == (want.decode_steps, want.rows_decoded, want.live_rows_decoded), counted
    assert int(b.rows_decoded) < int(b.num_decode_steps) * 4, counted
    assert len(set(b.lengths_b.tolist())) >= 3, b.lengths_b
assert streamed.compiled_programs() == 1
# Rows leave within their device's shard: the odd rollouts (device 1: a group's rollouts are
# spread over the devices) end at their first token, so device 0 keeps its 4 running rows and
# no row leaves until two of them end (across devices, 4 rows would fit rung 4 at once).
uneven = Sampler(plain.graphdef, plain.config, eos_ids=tuple(free.tokens_bt[1::2, 0]),
                 decode_chunk=0, row_buckets=2, plan=plan, state_shardings=param_sh)
_, b = run(uneven, params, temperature=1.0, prompt_index_r=index_r)
want = decode_schedule.simulate(b.lengths_b, 6, row_buckets=2, shards=2)
whole = decode_schedule.simulate(b.lengths_b, 6, row_buckets=2)
assert (b.lengths_b[1::2] == 1).all() and (b.lengths_b[::2] > 2).all(), b.lengths_b
assert int(b.rows_decoded) == want.rows_decoded > whole.rows_decoded, (b.rows_decoded, want)
# 3 slots do not split into the 2 batch shards: refused before anything compiles
odd = Sampler(plain.graphdef, plain.config, slots=3, plan=plan, state_shardings=param_sh)
try:
    odd.slots_for(8)
    raise AssertionError("3 slots over 2 shards were accepted")
except ValueError as e:
    assert "sampling.slots = 3 rows do not split into the mesh's 2 batch shards" in str(e), e
print("OK")
"""


@pytest.mark.heavy
def test_sharded_over_two_host_devices_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


@pytest.mark.slow
def test_compile_ahead_is_what_the_call_runs(setup, caplog):
    """`compile` builds the executable the next call of that shape runs: no second XLA compile
    (tracing once is not enough: a lowering with other argument shardings compiles again)."""
    _, sampler, state, ids_bt, lens_b, _ = setup
    fresh = Sampler(sampler.graphdef, sampler.config, eos_ids=(), decode_chunk=2)
    fresh.compile(state, *ids_bt.shape, max_new_tokens=5)
    with jax.log_compiles(), caplog.at_level(logging.DEBUG):
        fresh(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=5)
    compiled = [r.getMessage() for r in caplog.records if "compil" in r.getMessage()]
    assert not [m for m in compiled if "_generate_impl" in m], compiled
    assert fresh.compiled_programs() == 1
