"""The sampler's engine (issue #31): slots, row buckets and decode phases choose which rows an
iteration decodes, never the tokens; the program's counters follow `decode_schedule.simulate`; slots
refill with each rollout's own prompt; one prefill per prompt; the per-rollout random stream
draws from the policy's distribution.

Rollouts: 4 of each of 3 prompts, in a mixed order (INDEX_R), 12 in all, so a rollout that took
the wrong prompt, slot or random stream shows in its tokens.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax import decode_schedule
from sagc_jax.models import Decoder, get_preset
from sagc_jax.sampling import Sampler, left_pad

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [20]]
INDEX_R = np.array([2, 0, 0, 1, 2, 1, 0, 2, 1, 1, 0, 2], np.int32)
WIDTH = 8  # the prompt bucket
MAX_NEW = 8
# (seed, settings): greedy, the policy itself, and filtered
CALLS = [
    (0, dict(temperature=0.0)),
    (1, dict(temperature=1.0)),
    (2, dict(temperature=0.8, top_k=20, top_p=0.9)),
]
# (slots, row_buckets, decode_chunk); the reference decodes every rollout in its own row, at one
# rung, over one phase: what the sampler did before rows could leave the batch.
REFERENCE = (0, 1, 0)
ENGINES = [
    (0, 3, 3),  # all 12 slots, rungs 12, 6, 3, phases of 3, 6, 8 completion slots
    (4, 1, 0),  # 12 rollouts through 4 slots, one rung, one phase
    (4, 3, 3),  # through 4 slots, rungs 4, 2, 1, three phases
]
_IDS_PT, _LENS_P = left_pad(PROMPTS, pad_id=0, buckets=(WIDTH,))


def _call(sampler, state, seed, settings, ids_pt=None, index_r=INDEX_R):
    ids_pt = _IDS_PT if ids_pt is None else ids_pt
    out = sampler(
        state,
        ids_pt,
        _LENS_P,
        jax.random.key(seed),
        max_new_tokens=MAX_NEW,
        prompt_index_r=index_r,
        **settings,
    )
    return jax.device_get(out)


def _lengths_at(tokens_rl, eos_ids):
    """Each row's length when it ends at its first token in ``eos_ids`` (all of it if none)."""
    is_eos_rl = np.isin(tokens_rl, eos_ids)
    return np.where(is_eos_rl.any(1), is_eos_rl.argmax(1) + 1, tokens_rl.shape[1])


def _cut(out, lengths_r):
    """``out``'s tokens and logprobs kept up to each row's length, pad (0) after."""
    kept_rl = np.arange(MAX_NEW)[None, :] < lengths_r[:, None]
    return np.where(kept_rl, out.tokens_bt, 0), np.where(kept_rl, out.logprobs_bt, 0.0)


class Engine(NamedTuple):
    model: Decoder
    state: nnx.State
    free_outs: list  # the reference without end tokens, one output per call of CALLS
    eos_ids: tuple[int, ...]
    want_lengths: list  # [N] lengths the end tokens give each call's free run
    samplers: dict  # setting -> Sampler (with eos_ids)
    outs: dict  # (setting, seed) -> SampleOutput (numpy)


@pytest.fixture(scope="module")
def engine():
    """The model, the end tokens, and every engine's outputs for every call."""
    model = Decoder(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def sampler(setting, eos_ids):
        slots, row_buckets, chunk = setting
        return Sampler(
            graphdef,
            model.config,
            eos_ids=eos_ids,
            pad_id=0,
            slots=slots,
            row_buckets=row_buckets,
            decode_chunk=chunk,
        )

    free = sampler(REFERENCE, ())
    free_outs = [_call(free, state, seed, settings) for seed, settings in CALLS]
    # End tokens met early in some rows, late in others, never in some (checked below)
    g_rl, s_rl, f_rl = (out.tokens_bt for out in free_outs)
    eos_ids = (int(g_rl[1, 1]), int(g_rl[0, 4]), int(s_rl[0, 1]), int(s_rl[1, 4]), int(s_rl[2, 2]))
    eos_ids += (int(s_rl[4, 5]), int(f_rl[6, 3]), int(f_rl[7, 2]), int(f_rl[8, 5]))
    want_lengths = [_lengths_at(out.tokens_bt, eos_ids) for out in free_outs]
    samplers = {s: sampler(s, eos_ids) for s in [REFERENCE, *ENGINES]}
    outs = {
        (s, seed): _call(samplers[s], state, seed, settings)
        for s in samplers
        for seed, settings in CALLS
    }
    return Engine(model, state, free_outs, eos_ids, want_lengths, samplers, outs)


def test_end_tokens_cut_the_free_run(engine):
    """With end tokens, the reference samples the run without them up to each row's end (the
    stream of a rollout does not depend on when the others end), and the rows end at many
    different iterations, some never."""
    runs = zip(CALLS, engine.free_outs, engine.want_lengths, strict=True)
    for (seed, _), free, lengths_r in runs:
        out = engine.outs[REFERENCE, seed]
        ended_r = np.isin(out.tokens_bt, engine.eos_ids).any(1)
        np.testing.assert_array_equal(out.lengths_b, lengths_r)
        np.testing.assert_array_equal(out.truncated_b, ~ended_r)
        tokens_rl, logprobs_rl = _cut(free, lengths_r)
        np.testing.assert_array_equal(out.tokens_bt, tokens_rl)
        np.testing.assert_allclose(out.logprobs_bt, logprobs_rl, atol=1e-5)
        assert len(set(lengths_r.tolist())) >= 3 and lengths_r.min() <= 3, (seed, lengths_r)
    all_lengths = np.concatenate(engine.want_lengths)
    assert (all_lengths == MAX_NEW).any() and (all_lengths < MAX_NEW).sum() >= 12


@pytest.mark.parametrize("setting", ENGINES, ids=str)
def test_tokens_do_not_depend_on_slots_buckets_or_phases(engine, setting):
    outs = engine.outs
    for seed, _ in CALLS:
        out, want = outs[setting, seed], outs[REFERENCE, seed]
        np.testing.assert_array_equal(out.tokens_bt, want.tokens_bt, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(out.lengths_b, want.lengths_b)
        np.testing.assert_array_equal(out.truncated_b, want.truncated_b)
        np.testing.assert_allclose(out.logprobs_bt, want.logprobs_bt, atol=1e-5)


@pytest.mark.parametrize("setting", [REFERENCE, *ENGINES], ids=str)
def test_counters_are_the_schedule(engine, setting):
    """Decode iterations, rows decoded and running rows decoded, counted by the program, are
    what `decode_schedule.simulate` replays from the lengths; with several rungs, rows leave the
    batch as they finish, so fewer rows are decoded than iterations x slots."""
    samplers, outs = engine.samplers, engine.outs
    slots, row_buckets, chunk = setting
    num_slots = samplers[setting].slots_for(INDEX_R.size)
    assert num_slots == (slots or INDEX_R.size)
    for seed, _ in CALLS:
        out = outs[setting, seed]
        want = decode_schedule.simulate(
            out.lengths_b, MAX_NEW, slots=slots, chunk=chunk, row_buckets=row_buckets
        )
        counted = (int(out.num_decode_steps), int(out.rows_decoded), int(out.live_rows_decoded))
        assert counted == (want.decode_steps, want.rows_decoded, want.live_rows_decoded), seed
        assert int(out.live_rows_decoded) == int(out.lengths_b.sum()) - INDEX_R.size
        if row_buckets == 1:
            assert int(out.rows_decoded) == int(out.num_decode_steps) * num_slots
        else:
            assert int(out.rows_decoded) < int(out.num_decode_steps) * num_slots, seed


@pytest.mark.parametrize("setting", ENGINES, ids=str)
def test_without_end_tokens_every_engine_runs_the_free_run_to_the_cap(engine, setting):
    """Without end tokens every row runs to the cap (all slots at once: in lockstep, its loop
    conditions counted without a reduction over the rows): the tokens of the reference, and the
    schedule's counters of rows that all end at the cap (no row leaves)."""
    slots, row_buckets, chunk = setting
    sampler = Sampler(
        engine.samplers[setting].graphdef,
        engine.model.config,
        eos_ids=(),
        pad_id=0,
        slots=slots,
        row_buckets=row_buckets,
        decode_chunk=chunk,
    )
    for (seed, settings), free in zip(CALLS, engine.free_outs, strict=True):
        out = _call(sampler, engine.state, seed, settings)
        np.testing.assert_array_equal(out.tokens_bt, free.tokens_bt)
        np.testing.assert_allclose(out.logprobs_bt, free.logprobs_bt, rtol=1e-5, atol=1e-6)
        assert out.truncated_b.all() and out.lengths_b.min() == MAX_NEW
        want = decode_schedule.simulate(
            out.lengths_b, MAX_NEW, slots=slots, chunk=chunk, row_buckets=row_buckets
        )
        counted = (int(out.num_decode_steps), int(out.rows_decoded), int(out.live_rows_decoded))
        assert counted == (want.decode_steps, want.rows_decoded, want.live_rows_decoded), seed


@pytest.mark.parametrize(
    "setting, keep", list(zip([REFERENCE, *ENGINES], [1, 2, 1, 2], strict=True)), ids=str
)
def test_keep_groups_stops_once_enough_whole_groups_are_done(engine, setting, keep):
    """With keep_groups (tail batching) the program stops at the iteration
    `decode_schedule.group_stop` names from the full run's lengths: the rollouts done by then are
    the full run's, tokens and all; the cut ones hold a prefix of theirs (the same per-rollout
    stream), shorter; the counters are the schedule's up to the stop."""
    slots, row_buckets, chunk = setting
    sampler = Sampler(
        engine.samplers[setting].graphdef,
        engine.model.config,
        eos_ids=engine.eos_ids,
        pad_id=0,
        slots=slots,
        row_buckets=row_buckets,
        decode_chunk=chunk,
    )
    cut_rollouts = 0
    for seed, settings in CALLS:
        full = engine.outs[setting, seed]
        out = jax.device_get(
            sampler(
                engine.state,
                _IDS_PT,
                _LENS_P,
                jax.random.key(seed),
                max_new_tokens=MAX_NEW,
                prompt_index_r=INDEX_R,
                keep_groups=keep,
                **settings,
            )
        )
        stop_k, done_r = decode_schedule.group_stop(full.lengths_b, INDEX_R, keep, slots=slots)
        assert int(out.num_decode_steps) == stop_k, seed
        np.testing.assert_array_equal(out.cut_b, ~done_r)
        whole = [g for g in range(len(PROMPTS)) if done_r[INDEX_R == g].all()]
        assert len(whole) >= keep
        np.testing.assert_array_equal(out.tokens_bt[done_r], full.tokens_bt[done_r])
        np.testing.assert_array_equal(out.lengths_b[done_r], full.lengths_b[done_r])
        cut = ~done_r
        cut_rollouts += cut.sum()
        assert (out.lengths_b[cut] < full.lengths_b[cut]).all() and out.truncated_b[cut].all()
        prefix_rl = np.arange(MAX_NEW)[None, :] < out.lengths_b[:, None]
        np.testing.assert_array_equal(
            np.where(prefix_rl, full.tokens_bt, 0), np.where(prefix_rl, out.tokens_bt, 0)
        )
        want = decode_schedule.simulate(
            full.lengths_b,
            MAX_NEW,
            slots=slots,
            chunk=chunk,
            row_buckets=row_buckets,
            stop_at=stop_k,
        )
        counted = (int(out.num_decode_steps), int(out.rows_decoded), int(out.live_rows_decoded))
        assert counted == (want.decode_steps, want.rows_decoded, want.live_rows_decoded), seed
    assert not full.cut_b.any() and cut_rollouts > 0


def test_fewer_slots_take_more_iterations_and_fewer_rows(engine):
    """The same rollouts through 4 slots: more iterations than with all 12, fewer rows; row
    buckets cut the rows of the tail further."""
    outs = engine.outs
    for seed, _ in CALLS:
        every, streamed, tail = (outs[s, seed] for s in [REFERENCE, (4, 1, 0), (4, 3, 3)])
        assert int(streamed.num_decode_steps) > int(every.num_decode_steps)
        assert int(streamed.rows_decoded) < int(every.rows_decoded)
        assert int(tail.num_decode_steps) == int(streamed.num_decode_steps)
        assert int(tail.rows_decoded) < int(streamed.rows_decoded)


@nnx.jit
def _policy_logprobs_tv(model, tokens_bt):
    return jax.nn.log_softmax(model(tokens_bt), axis=-1)


@pytest.mark.parametrize("setting", [(4, 1, 0), (4, 3, 3)], ids=str)
def test_refill_returns_every_rollout_complete_with_its_own_prompt(engine, setting):
    model, state, _, eos_ids, _, samplers, outs = engine
    for seed, _ in CALLS:
        out = outs[setting, seed]
        lengths_r = out.lengths_b
        after_rl = np.arange(MAX_NEW)[None, :] >= lengths_r[:, None]
        assert (lengths_r >= 1).all()
        assert (out.tokens_bt[after_rl] == 0).all() and (out.logprobs_bt[after_rl] == 0).all()
        last_r = out.tokens_bt[np.arange(INDEX_R.size), lengths_r - 1]
        np.testing.assert_array_equal(np.isin(last_r, eos_ids), ~out.truncated_b)
    # Greedy: rollout r's completion is its prompt's, decoded alone (one rollout per prompt).
    alone = _call(samplers[REFERENCE], state, 0, CALLS[0][1], index_r=None)
    assert len({tuple(row) for row in alone.tokens_bt}) == len(PROMPTS)
    np.testing.assert_array_equal(outs[setting, 0].tokens_bt, alone.tokens_bt[INDEX_R])
    # Sampled: every rollout's log-probabilities are its prompt's policy (one full forward
    # each, right-padded to one width: causal attention does not look at the padding).
    out = outs[setting, 1]
    assert len({tuple(row) for row in out.tokens_bt}) == INDEX_R.size
    for r, p in enumerate(INDEX_R):
        n = int(out.lengths_b[r])
        seq_t = np.zeros(WIDTH + MAX_NEW, np.int32)
        seq_t[: len(PROMPTS[p]) + n] = PROMPTS[p] + out.tokens_bt[r, :n].tolist()
        logprobs_tv = np.asarray(_policy_logprobs_tv(model, jnp.asarray(seq_t[None]))[0])
        rows_t = np.arange(len(PROMPTS[p]) - 1, len(PROMPTS[p]) - 1 + n)
        want = logprobs_tv[rows_t, seq_t[rows_t + 1]]
        np.testing.assert_allclose(out.logprobs_bt[r, :n], want, atol=1e-4, err_msg=f"row {r}")


def test_one_program_for_other_prompts_keys_and_settings(engine):
    state, streamed = engine.state, engine.samplers[4, 3, 3]
    assert streamed.compiled_programs() == 1  # the fixture's three calls
    ids_pt, _ = left_pad([[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]], pad_id=0, buckets=(WIDTH,))
    for seed, settings in [(5, dict(temperature=0.5)), (6, dict(temperature=1.2, top_k=3))]:
        _call(streamed, state, seed, settings, ids_pt=ids_pt, index_r=INDEX_R[::-1].copy())
    _call(streamed, state, 7, dict(temperature=1.0), index_r=np.zeros(12, np.int64))
    assert streamed.compiled_programs() == 1


def test_one_prefill_per_prompt(engine, monkeypatch):
    """3 prompts x 4 rollouts: the program runs the model once over [3, width] (the prefill);
    every other call of the model is one decode token for the rows of a rung. (The sampler is
    fresh, so it traces; its program is the fixture's (4, 3, 3) one, which the persistent
    compilation cache then loads instead of compiling again.)"""
    model, state, _, eos_ids, _, _, outs = engine
    calls = []
    apply_cached = Decoder.apply_cached

    def counting(self, tokens_bt, cache, **kwargs):
        calls.append(tokens_bt.shape)
        return apply_cached(self, tokens_bt, cache, **kwargs)

    monkeypatch.setattr(Decoder, "apply_cached", counting)
    fresh = Sampler(
        nnx.graphdef(model), model.config, eos_ids=eos_ids, slots=4, row_buckets=3, decode_chunk=3
    )
    grouped_r = np.repeat(np.arange(len(PROMPTS)), 4)
    out = _call(fresh, state, 0, CALLS[0][1], index_r=grouped_r)
    assert fresh.compiled_programs() == 1  # traced here, so every model call was recorded
    assert [shape for shape in calls if shape[1] > 1] == [(len(PROMPTS), WIDTH)]
    assert {shape for shape in calls if shape[1] == 1} == {(4, 1), (2, 1), (1, 1)}  # the rungs
    assert int(out.prefill_rows) == len(PROMPTS)
    greedy = outs[REFERENCE, 0]  # rollout r of INDEX_R decodes prompt INDEX_R[r]
    np.testing.assert_array_equal(out.tokens_bt, greedy.tokens_bt[np.argsort(INDEX_R, stable=True)])


@pytest.mark.parametrize(
    "index_r, match",
    [
        ([0, 3], r"holds 0\.\.3; each must index one of the 3 prompts"),
        ([-1, 0], r"holds -1\.\.0"),
        ([[0, 1]], "1-D integer array, got shape \\(1, 2\\)"),
        ([0.0, 1.0], "1-D integer array, got shape \\(2,\\) of float64"),
        ([], "non-empty"),
    ],
)
def test_bad_prompt_index_is_refused(engine, index_r, match):
    with pytest.raises(ValueError, match=match):
        _call(engine.samplers[REFERENCE], engine.state, 0, {}, index_r=np.asarray(index_r))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(slots=-1), r"slots=-1; use an int >= 0"),
        (dict(slots=2.0), r"slots=2\.0"),
        (dict(row_buckets=0), r"row_buckets=0; use an int >= 1"),
        (dict(row_buckets=True), r"row_buckets=True"),
    ],
)
def test_bad_slots_or_row_buckets_are_refused(kwargs, match):
    cfg = get_preset("tiny", **SMALL)
    graphdef = nnx.graphdef(Decoder(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=match):
        Sampler(graphdef, cfg, **kwargs)


# ---------------------------------------------------------------------- the random stream
DIST_VOCAB = 8  # few tokens, so each has a frequency worth measuring
DIST_ROLLOUTS = 2000
DIST_PROMPT = [1, 2, 3]


def _tolerance(p_v, n):
    """5 binomial standard errors of a frequency over n draws (plus one count: the estimate of
    a tiny probability is whole counts)."""
    return 5 * np.sqrt(p_v * (1 - p_v) / n) + 1 / n


def test_stream_draws_from_the_policy():
    """2000 rollouts of one prompt at temperature 1: the frequencies of token 0, and of token 1
    after the most frequent token 0, are the full forward pass's softmax within 5 binomial
    standard errors each (fixed seeds: deterministic; 5 sigma: a correct stream is far from
    failing). A wrong stream fails: rollouts sharing one uniform all draw the same token 0 (the
    check before the comparison makes sure a one-token frequency is outside the tolerance, and
    so is the uniform distribution); a stream that ignores the token index draws token 1 with
    token 0's uniform, which fails the conditional frequencies (both tried by hand). Then the
    same rollouts through 500 slots with row buckets and an end token (rollouts ending at their
    first token free their slots at once): the same tokens up to each end."""
    cfg = get_preset("tiny", **SMALL | dict(vocab_size=DIST_VOCAB))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids_pt, lens_p = left_pad([DIST_PROMPT], pad_id=0, buckets=(4,))
    index_r = np.zeros(DIST_ROLLOUTS, np.int32)

    def run(**kwargs):
        sampler = Sampler(graphdef, cfg, pad_id=0, **kwargs)
        out = sampler(
            state, ids_pt, lens_p, jax.random.key(0), max_new_tokens=3, prompt_index_r=index_r
        )
        return jax.device_get(out)

    out = run(eos_ids=(), decode_chunk=0, slots=0, row_buckets=1)
    first_r, second_r = out.tokens_bt[:, 0], out.tokens_bt[:, 1]

    def policy(prefix):
        logits_tv = model(jnp.asarray([DIST_PROMPT + prefix], jnp.int32))[0]
        return np.asarray(jax.nn.softmax(logits_tv[-1]), np.float64)

    p0_v = policy([])
    top = int(np.bincount(first_r, minlength=DIST_VOCAB).argmax())
    after_r = second_r[first_r == top]
    p1_v = policy([top])
    for p_v, tokens, name in [(p0_v, first_r, "token 0"), (p1_v, after_r, f"token 1 | {top}")]:
        n = tokens.size
        assert n >= 500, (name, n)
        tol_v = _tolerance(p_v, n)
        # the test's power: uniform and one-token frequencies are outside the tolerance
        assert (np.abs(p_v - 1 / DIST_VOCAB) > tol_v).any() and (1 - p_v > tol_v).all(), name
        freq_v = np.bincount(tokens, minlength=DIST_VOCAB) / n
        np.testing.assert_array_less(np.abs(freq_v - p_v), tol_v, err_msg=name)

    # rollouts ending at the second most likely first token free their slots at once; the
    # others run on through 500 slots, rungs of 500, 250, 125
    end = int(np.argsort(p0_v)[-2])
    streamed = run(eos_ids=(end,), decode_chunk=0, slots=500, row_buckets=3)
    lengths_r = _lengths_at(out.tokens_bt, (end,))
    np.testing.assert_array_equal(streamed.lengths_b, lengths_r)
    assert (lengths_r == 1).sum() >= 100
    want = decode_schedule.simulate(lengths_r, 3, slots=500, row_buckets=3)
    assert int(streamed.rows_decoded) == want.rows_decoded
    assert want.rows_k.min() < 500  # the smaller rungs ran
    kept_rl = np.arange(3)[None, :] < lengths_r[:, None]
    np.testing.assert_array_equal(streamed.tokens_bt, np.where(kept_rl, out.tokens_bt, 0))
    np.testing.assert_allclose(
        streamed.logprobs_bt, np.where(kept_rl, out.logprobs_bt, 0.0), atol=1e-5
    )
