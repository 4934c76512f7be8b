"""The decode loop's functions (``sampling/decode.py``), each on its own, on a tiny model: the
prefill, a start's prompt copies and first tokens, refill, one iteration, the gather into a
rung, the tail's rungs, the exit test of keep_groups, the cache's blocks. Each test jits the
prefill and the function under test into one program (`_run`; the context is static).

3 prompts; rollouts of INDEX_R (a mixed order), so a row that took the wrong prompt shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax import decode_schedule
from sagc_jax.models import Decoder, get_preset
from sagc_jax.models.layers import cache_blocks
from sagc_jax.sampling import decode, left_pad

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [20]]
INDEX_R = np.array([2, 0, 1, 1, 0, 2], np.int32)
WIDTH, LENGTH = 8, 6


@pytest.fixture(scope="module")
def tiny():
    model = Decoder(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids_pt, lens_p = left_pad(PROMPTS, pad_id=0, buckets=(WIDTH,))
    return model, graphdef, state, jnp.asarray(ids_pt), jnp.asarray(WIDTH - lens_p, jnp.int32)


def _ctx(tiny, *, slots, index_r=INDEX_R, eos_ids=(), rungs=None, caps=(LENGTH,), keep=0):
    model, graphdef = tiny[:2]
    return decode.Context(
        graphdef=graphdef,
        config=model.config,
        plan=None,
        eos_ids=tuple(eos_ids),
        pad_id=0,
        rollouts=len(index_r),
        prompts=len(PROMPTS),
        prompt_len=WIDTH,
        length=LENGTH,
        slots=slots,
        caps=caps,
        rungs=rungs or (slots,),
        keep_groups=keep,
    )


def _run(tiny, ctx, fn, index_r=INDEX_R, temperature=0.0, seed=0):
    """``fn(inputs)`` after the prefill of PROMPTS for rollouts ``index_r``, in one jitted
    program, as numpy."""
    _, _, state, ids_pt, start_p = tiny

    def program(state, index_r, key, temperature):
        settings = (temperature, jnp.float32(1.0), jnp.int32(0))
        return fn(decode.prefill(ctx, state, ids_pt, start_p, index_r, key, *settings))

    args = (jnp.asarray(index_r, jnp.int32), jax.random.key(seed), jnp.float32(temperature))
    return jax.device_get(jax.jit(program)(state, *args))


@nnx.jit
def _logprobs_tv(model, tokens_bt):
    return jax.nn.log_softmax(model(tokens_bt).astype(jnp.float32), axis=-1)


def _next_logprobs(model, prompt, tokens):
    """float32 [V]: log_softmax of the model's logits after ``prompt + tokens`` (one full,
    unpadded forward pass)."""
    return np.asarray(_logprobs_tv(model, jnp.asarray([[*prompt, *tokens]], jnp.int32))[0, -1])


def test_prefill_gives_each_prompts_last_logits_and_the_group_tables(tiny):
    model = tiny[0]
    index_r = np.array([2, 0, 2, 2], np.int32)  # prompt 1 has no rollout
    ctx = _ctx(tiny, slots=4, index_r=index_r, keep=3)
    assert hash(ctx) == hash(_ctx(tiny, slots=4, index_r=index_r, keep=3))  # static
    inputs = _run(tiny, ctx, lambda inputs: inputs._replace(model=None), index_r)
    for p, prompt in enumerate(PROMPTS):
        logprobs_v = _next_logprobs(model, prompt, [])
        got_v = jax.nn.log_softmax(inputs.logits_pv[p])
        np.testing.assert_allclose(got_v, logprobs_v, atol=1e-4, err_msg=p)
    want_k = inputs.prompt_cache.k_lbkhs[0]
    assert want_k.shape[0] == len(PROMPTS) and want_k.shape[3] == WIDTH
    np.testing.assert_array_equal(inputs.size_g, [1, 0, 3])
    np.testing.assert_array_equal(inputs.quota, [2])  # keep 3, but 2 groups have rollouts
    np.testing.assert_array_equal(inputs.part_g, [0, 0, 0])


def test_start_copies_each_prompt_into_its_slot_and_draws_its_first_token(tiny):
    """Rollouts 3 and 1 take slots 2 and 0 (an invalid third entry changes nothing): their
    prompts' keys and values in the slots' first T columns, the prompts' start slots, token 0
    the greedy token of the prompt, its log-probability; slot 2's occupant (rollout 5, with
    two tokens) is written out first; the other slots are untouched."""
    model = tiny[0]
    ctx = _ctx(tiny, slots=4)
    occupant = np.zeros((4, LENGTH), np.int32)
    occupant[2, :2] = [41, 42]

    def fn(inputs):
        cache = decode.empty_cache(model.config, None, 4, WIDTH + LENGTH)
        run = decode.empty_run(ctx)
        run = run._replace(
            slots=run.slots._replace(
                rollout_s=jnp.asarray([0, 0, 5, 0], jnp.int32),
                age_s=jnp.asarray([0, 0, 2, 0], jnp.int32),
                tokens_sl=jnp.asarray(occupant),
            )
        )
        slot_j, rollout_j = jnp.asarray([2, 0, 1]), jnp.asarray([3, 1, 4])
        valid_j = jnp.asarray([True, True, False])
        cache, run = decode.start(ctx, inputs, cache, run, slot_j, rollout_j, valid_j)
        return cache, run, inputs.prompt_cache

    cache, run, prompts = _run(tiny, ctx, fn)
    k_bkhs, v_bksh = cache.k_lbkhs[0], cache.v_lbksh[0]
    for slot, rollout in [(2, 3), (0, 1)]:
        p = INDEX_R[rollout]
        np.testing.assert_array_equal(k_bkhs[slot, :, :, :WIDTH], prompts.k_lbkhs[0][p])
        np.testing.assert_array_equal(v_bksh[slot, :, :WIDTH], prompts.v_lbksh[0][p])
        assert not k_bkhs[slot, :, :, WIDTH:].any()
        assert int(cache.start_b[slot]) == WIDTH - len(PROMPTS[p])
        logprobs_v = _next_logprobs(model, PROMPTS[p], [])
        token = int(np.argmax(logprobs_v))
        assert int(run.slots.rollout_s[slot]) == rollout and int(run.slots.age_s[slot]) == 1
        assert int(run.slots.last_s[slot]) == token == int(run.slots.tokens_sl[slot, 0])
        np.testing.assert_allclose(run.slots.logprobs_sl[slot, 0], logprobs_v[token], atol=1e-5)
        assert run.slots.live_s[slot] and not run.slots.ended_s[slot]
        assert not run.slots.tokens_sl[slot, 1:].any()
    for slot in (1, 3):  # not started: zeros, no rollout
        assert not k_bkhs[slot].any() and not run.slots.live_s[slot]
    np.testing.assert_array_equal(run.tokens_nl[5], occupant[2])
    assert int(run.lengths_n[5]) == 2
    assert not run.tokens_nl[np.arange(6) != 5].any()


def test_a_rollout_ending_at_its_first_token_is_done_at_once(tiny):
    model = tiny[0]
    first = int(np.argmax(_next_logprobs(model, PROMPTS[INDEX_R[0]], [])))
    ctx = _ctx(tiny, slots=6, eos_ids=(first,), keep=1)
    _, run = _run(tiny, ctx, lambda inputs: decode.first_start(ctx, inputs))
    slots = run.slots
    np.testing.assert_array_equal(slots.rollout_s, np.arange(6))  # one shard: in order
    ended = slots.tokens_sl[:, 0] == first
    assert ended[0] and not ended.all()
    np.testing.assert_array_equal(slots.ended_s, ended)
    np.testing.assert_array_equal(slots.live_s, ~ended)
    np.testing.assert_array_equal(run.done_g, np.bincount(INDEX_R[ended], minlength=3))


def test_refill_fills_only_free_slots_with_the_waiting_rollouts_in_order(tiny):
    """4 slots, 6 rollouts: slots 1 and 3 free up; refill (one rollout a pass: 4 slots / 8)
    gives them rollouts 4 and 5, writes out their occupants, and leaves slots 0 and 2 as they
    were; with no rollout waiting it changes nothing."""
    ctx = _ctx(tiny, slots=4)
    assert ctx.refill_width == 1 and ctx.refilling

    def fn(inputs):
        cache, before = decode.first_start(ctx, inputs)
        freed = before.slots._replace(live_s=jnp.asarray([True, False, True, False]))
        cache, after = decode.refill(ctx, inputs, cache, before._replace(slots=freed))
        none_free = after.slots._replace(live_s=jnp.zeros(4, bool))
        _, again = decode.refill(ctx, inputs, cache, after._replace(slots=none_free))
        return before, cache, after, again, inputs.prompt_cache

    before, cache, after, again, prompts = _run(tiny, ctx, fn)
    assert int(before.waiting) == 4 and before.slots.live_s.all()
    assert int(after.waiting) == 6
    np.testing.assert_array_equal(after.slots.rollout_s, [0, 4, 2, 5])
    assert after.slots.live_s.all()
    for leaf, old in zip(after.slots, before.slots, strict=True):
        np.testing.assert_array_equal(leaf[[0, 2]], old[[0, 2]])
    np.testing.assert_array_equal(after.tokens_nl[[1, 3]], before.slots.tokens_sl[[1, 3]])
    assert not after.tokens_nl[[0, 2, 4, 5]].any()
    for slot, rollout in [(1, 4), (3, 5)]:
        want = prompts.k_lbkhs[0][INDEX_R[rollout]]
        np.testing.assert_array_equal(cache.k_lbkhs[0][slot, :, :, :WIDTH], want)
    # none waits: the free slots stay as they are
    np.testing.assert_array_equal(again.slots.rollout_s, [0, 4, 2, 5])
    assert int(again.waiting) == 6 and not again.slots.live_s.any()


def test_iterate_advances_running_rows_and_ends_rows_at_an_end_token(tiny):
    """3 rows of 3 rollouts (one per prompt), greedy, row 2 finished: a running row samples its
    prompt's next greedy token (the full forward's argmax) at column 1, the finished row is
    left alone; with row 0's token as an end token, row 0 stops, ended."""
    model = tiny[0]
    index_r = np.arange(3, dtype=np.int32)
    firsts = [int(np.argmax(_next_logprobs(model, p, []))) for p in PROMPTS]
    seconds = [
        int(np.argmax(_next_logprobs(model, p, [t]))) for p, t in zip(PROMPTS, firsts, strict=True)
    ]
    assert seconds[0] not in firsts[:2] and seconds[1] != seconds[0]  # the test's premise
    for ends in ((), (seconds[0],)):
        ctx = _ctx(tiny, slots=3, index_r=index_r, eos_ids=ends)

        def fn(inputs, ctx=ctx):
            cache, run = decode.first_start(ctx, inputs)
            slots = run.slots._replace(live_s=jnp.asarray([True, True, False]))
            return decode.iterate(ctx, inputs, cache, slots, run, LENGTH)[1:]

        after, run = _run(tiny, ctx, fn, index_r)
        assert int(run.steps) == 1 and int(run.rows) == 3
        np.testing.assert_array_equal(after.age_s, [2, 2, 1])
        np.testing.assert_array_equal(after.tokens_sl[:, 0], firsts)
        np.testing.assert_array_equal(after.tokens_sl[:2, 1], seconds[:2])
        assert int(after.tokens_sl[2, 1]) == 0 and int(after.last_s[2]) == 0
        want = _next_logprobs(model, PROMPTS[1], [firsts[1]])[seconds[1]]
        np.testing.assert_allclose(after.logprobs_sl[1, 1], want, atol=1e-5)
        np.testing.assert_array_equal(after.live_s, [not ends, True, False])
        np.testing.assert_array_equal(after.ended_s, [bool(ends), False, False])


def test_gather_takes_the_running_rows_in_slot_order(tiny):
    """4 slots, rows 1 and 3 running: a rung of 2 rows holds them in slot order, with their
    cache rows (blocks joined, zeros up to the width); every row's completion is written out.
    With none running, the rung's cache is empty. (An end token no row draws: the rows are
    counted, not in lockstep.)"""
    never = SMALL["vocab_size"]
    ctx = _ctx(tiny, slots=4, index_r=INDEX_R[:4], rungs=(4, 2), caps=(3, LENGTH), eos_ids=(never,))

    def fn(inputs):
        cache, run = decode.first_start(ctx, inputs)
        cache = decode.grow(ctx, cache, WIDTH + LENGTH)  # two blocks
        some = run.slots._replace(live_s=jnp.asarray([False, True, False, True]))
        none = run.slots._replace(live_s=jnp.zeros(4, bool))
        taken = decode.gather(ctx, inputs, cache, some, run, 2, ctx.full_width)
        empty = decode.gather(ctx, inputs, cache, none, run, 2, ctx.full_width)
        return cache, some, taken, empty

    cache, slots, (part, kept, out), (empty, first, _) = _run(tiny, ctx, fn, INDEX_R[:4])
    np.testing.assert_array_equal(kept.rollout_s, [1, 3])
    np.testing.assert_array_equal(kept.live_s, [True, True])
    np.testing.assert_array_equal(kept.tokens_sl, slots.tokens_sl[[1, 3]])
    k_bkhs = np.concatenate(cache_blocks(cache.k_lbkhs[0]), axis=3)
    assert k_bkhs[[1, 3], :, :, :WIDTH].any()
    np.testing.assert_array_equal(part.k_lbkhs[0], k_bkhs[[1, 3]])
    assert part.k_lbkhs[0].shape[3] == ctx.full_width
    np.testing.assert_array_equal(part.start_b, cache.start_b[[1, 3]])
    np.testing.assert_array_equal(out.tokens_nl, slots.tokens_sl)  # rollouts 0..3 in slots 0..3
    np.testing.assert_array_equal(out.lengths_n, slots.age_s)
    assert not empty.k_lbkhs[0].any()
    np.testing.assert_array_equal(first.rollout_s, [0, 1])


def _decoded(tiny, ctx, index_r):
    """The run `decode` ends with from `first_start`, temperature 1."""

    def program(inputs):
        return decode.decode(ctx, inputs, *decode.first_start(ctx, inputs))

    return _run(tiny, ctx, program, index_r, temperature=1.0, seed=3)


def test_the_tail_rungs_decode_the_same_tokens_with_fewer_rows(tiny):
    """The phases and rungs (4, 2, 1) against one phase at 4 rows, end tokens met at several
    lengths, temperature 1: the same tokens and log-probabilities; the counters are the
    schedule's, fewer rows than iterations x slots. `in_tail` holds once none waits and the
    rows fit rung 2."""
    index_r = INDEX_R[:4]
    free = _decoded(tiny, _ctx(tiny, slots=4, index_r=index_r), index_r)
    ends = (int(free.tokens_nl[1, 2]), int(free.tokens_nl[3, 1]))
    outs = [
        _decoded(tiny, _ctx(tiny, slots=4, index_r=index_r, eos_ids=ends, **kw), index_r)
        for kw in (dict(), dict(rungs=(4, 2, 1), caps=(3, LENGTH)))
    ]
    one, rungs = outs
    np.testing.assert_array_equal(rungs.tokens_nl, one.tokens_nl)
    np.testing.assert_allclose(rungs.logprobs_nl, one.logprobs_nl, atol=1e-5)
    lengths = rungs.lengths_n
    assert len(set(lengths.tolist())) >= 2 and lengths.min() < LENGTH
    want = decode_schedule.simulate(lengths, LENGTH, chunk=3, row_buckets=3)
    assert (int(rungs.steps), int(rungs.rows)) == (want.decode_steps, want.rows_decoded)
    assert int(rungs.rows) < int(rungs.steps) * 4
    streamed = _ctx(tiny, slots=4, rungs=(4, 2, 1))  # 6 rollouts
    run = decode.empty_run(streamed)
    assert not decode.in_tail(streamed, jnp.int32(2), run)  # rollouts 4 and 5 wait
    done = run._replace(waiting=jnp.int32(6))
    assert decode.in_tail(streamed, jnp.int32(2), done)
    assert not decode.in_tail(streamed, jnp.int32(3), done)


def test_rung_runs_the_gathered_rows_to_their_ends(tiny):
    """Two iterations at 4 rows, then rows 1 and 3 (the others stopped) gathered into rung 2
    of (4, 2, 1): `rung` decodes them to the cap, 2 rows an iteration, with the tokens the
    whole decode gives them. (An end token no row draws: the rows are counted, not in
    lockstep.)"""
    index_r = INDEX_R[:4]
    never = SMALL["vocab_size"]
    ctx = _ctx(tiny, slots=4, index_r=index_r, rungs=(4, 2, 1), eos_ids=(never,))
    assert not ctx.lockstep

    def fn(inputs):
        cache, run = decode.first_start(ctx, inputs)
        whole = decode.decode(ctx, inputs, cache, run)
        for _ in range(2):
            cache, slots, run = decode.iterate(ctx, inputs, cache, run.slots, run, LENGTH)
            run = run._replace(slots=slots)
        slots = run.slots._replace(live_s=jnp.asarray([False, True, False, True]))
        part, kept, run = decode.gather(ctx, inputs, cache, slots, run, 2, ctx.full_width)
        return whole, decode.rung(ctx, inputs, 1, part, kept, run)

    whole, out = _run(tiny, ctx, fn, index_r, temperature=1.0, seed=3)
    np.testing.assert_array_equal(out.tokens_nl[[1, 3]], whole.tokens_nl[[1, 3]])
    np.testing.assert_allclose(out.logprobs_nl[[1, 3]], whole.logprobs_nl[[1, 3]], atol=1e-5)
    np.testing.assert_array_equal(out.tokens_nl[[0, 2], :3], whole.tokens_nl[[0, 2], :3])
    np.testing.assert_array_equal(out.lengths_n, [3, LENGTH, 3, LENGTH])
    assert int(out.steps) == LENGTH - 1 and int(out.rows) == 2 * 4 + 3 * 2


def test_the_exit_test_fires_once_keep_groups_groups_are_whole(tiny):
    """Groups of 2 rollouts each (INDEX_R): `count_done` counts rollouts by prompt; `enough`
    holds once keep_groups groups have every rollout done, not before, and `status` then
    reports no running row."""
    # rollouts 2 and 3 (both of prompt 1), then 0 (prompt 2), then 5 (prompt 2)
    steps = [([2], 0), ([3], 1), ([0], 1), ([5], 2)]
    for keep in (1, 2):
        ctx = _ctx(tiny, slots=6, keep=keep)

        def fn(inputs, ctx=ctx):
            run = decode.empty_run(ctx)
            enough = [decode.enough(ctx, inputs, run)]
            for rollouts, _ in steps:
                done_b = jnp.ones(len(rollouts), bool)
                run = decode.count_done(ctx, run, done_b, jnp.asarray(INDEX_R[rollouts]))
                enough.append(decode.enough(ctx, inputs, run))
            slots = run.slots._replace(live_s=jnp.ones(6, bool))
            return jnp.stack(enough), run.done_g, decode.status(ctx, inputs, slots, run, LENGTH)

        enough, done_g, (live, _) = _run(tiny, ctx, fn)
        np.testing.assert_array_equal(enough, [False] + [whole >= keep for _, whole in steps])
        np.testing.assert_array_equal(done_g, [0, 2, 2])
        assert int(live) == 0
    without = _ctx(tiny, slots=6)
    run = decode.count_done(without, decode.empty_run(without), jnp.ones(1, bool), jnp.ones(1))
    assert not np.asarray(run.done_g).any()  # counted with keep_groups only


def test_status_counts_the_running_rows_and_those_past_the_cap(tiny):
    ctx = _ctx(tiny, slots=6, eos_ids=(1,))
    run = decode.empty_run(ctx)
    slots = run.slots._replace(
        live_s=jnp.asarray([True, False, True, True, False, False]),
        age_s=jnp.asarray([4, 1, 2, 5, 6, 1], jnp.int32),
    )
    live, over = decode.status(ctx, None, slots, run, 4)  # inputs: read by keep_groups only
    assert (int(live), int(over)) == (3, 1)
    lockstep = _ctx(tiny, slots=6)  # no end token, every rollout in a slot: ages are steps + 1
    assert lockstep.lockstep and not ctx.lockstep
    live, over = decode.status(lockstep, None, slots, run._replace(steps=jnp.int32(4)), 4)
    assert (int(live), int(over)) == (6, 6)


def test_grow_appends_a_zero_block_and_joined_makes_one_array(tiny):
    ctx = _ctx(tiny, slots=2, index_r=INDEX_R[:2])
    cache = decode.empty_cache(ctx.config, None, 2, 5)
    cache = cache._replace(k_lbkhs=(cache.k_lbkhs[0] + 1.0,))
    grown = decode.grow(ctx, cache, 9)
    first, added = grown.k_lbkhs[0]
    assert grown.slots == 9 and added.shape[3] == 4 and not np.asarray(added).any()
    assert first is cache.k_lbkhs[0]  # the written slots are not copied
    one = decode.joined(ctx, grown, 12)
    assert one.k_lbkhs[0].shape[3] == 12
    np.testing.assert_array_equal(one.k_lbkhs[0][..., :5], 1.0)
    assert not np.asarray(one.k_lbkhs[0][..., 5:]).any()
