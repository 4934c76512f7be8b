"""The decode loop of `Sampler`, as functions over an explicit state: the KV cache and a `Run`
(the rows in the slots, `Slots`, and the outputs by rollout), each function taking a static
`Context` first and the call's arrays (`Inputs`) next. ``schedule`` states the order of events
these functions follow; `Sampler` (``sampler``) checks a call's arguments and jits the program
that runs `prefill`, `first_start` and `decode`.

- `prefill`: one prefill per prompt, and the tables of the ``keep_groups`` exit test.
- `first_start`: every slot takes its first rollout (`start`), free slots refill (`refill`).
- `decode`: the phases at all slots (`all_slots`: `iterations` of `iterate`, `refill` after
  each while rollouts wait), then the tail's rungs (`rung`), rows gathered into each (`gather`).
- `status` counts the running rows a loop condition needs; `enough` is the exit test.

Letters: N rollouts, S slots, L max_new_tokens, P prompts, T the prompt bucket, B the rows of
the current rung, j the rollouts a `start` places, V vocab, h batch shards, k rows per shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sagc_jax.decode_schedule import REFILL_SHARE, first_rollouts
from sagc_jax.models import Decoder, DecoderConfig, KVCache, init_cache
from sagc_jax.models.layers import cache_blocks
from sagc_jax.parallel import ShardingPlan
from sagc_jax.sampling.functions import sample_token


@dataclasses.dataclass(frozen=True)
class Context:
    """What one program of the sampler fixes: its shapes and settings, Python values (static;
    hashable). ``caps`` are `schedule.phase_slots`'s completion slots per phase, ``rungs``
    `schedule.row_rungs`'s row counts (``rungs[0] == slots``)."""

    graphdef: nnx.GraphDef
    config: DecoderConfig
    plan: ShardingPlan | None  # None: one device, no sharding constraints
    eos_ids: tuple[int, ...]  # empty: rows run to the cap
    pad_id: int
    rollouts: int  # N
    prompts: int  # P
    prompt_len: int  # T
    length: int  # L = max_new_tokens
    slots: int  # S
    caps: tuple[int, ...]
    rungs: tuple[int, ...]
    keep_groups: int  # 0: no exit test

    @property
    def shards(self) -> int:
        """h: the batch shards the slots split into (rows gathered within each)."""
        return self.plan.batch_shards if self.plan is not None else 1

    @property
    def refill_width(self) -> int:
        """Rollouts one refill pass may start (each copies its prompt's cache)."""
        return max(1, -(-self.slots // REFILL_SHARE))

    @property
    def refilling(self) -> bool:
        """More rollouts than slots: slots take waiting rollouts as they free up."""
        return self.rollouts > self.slots

    @property
    def lockstep(self) -> bool:
        """No end token and every rollout started together: every row runs to the cap, its age
        is 1 + steps, and counting rows needs no reduction."""
        return not self.eos_ids and not self.refilling

    @property
    def tail(self) -> bool:
        """Rungs below all slots: the running rows leave for them once they fit."""
        return len(self.rungs) > 1

    @property
    def full_width(self) -> int:
        """Cache slots of the tail's rows: the prompt and every completion slot."""
        return self.prompt_len + self.length

    @property
    def parts(self) -> int:
        """Processes whose prompts the exit test counts apart (each part of the prompt table)."""
        return jax.process_count() if self.plan is not None else 1


class Inputs(NamedTuple):
    """The call's arrays that every step reads and none changes (the loops close over them:
    they are not carried)."""

    model: Decoder  # merged from the context's graphdef and the call's (gathered) state
    prompt_index_r: jax.Array  # int32 [N]: each rollout's prompt
    start_p: jax.Array  # int32 [P]: each prompt's first cache slot (its left padding)
    logits_pv: jax.Array  # float [P, V]: each prompt's last logits (its rollouts' token 0)
    prompt_cache: KVCache  # [P, T]: the prompts' keys and values
    key: jax.Array  # the call's key: token t of rollout r draws with fold_in(fold_in(key, r), t)
    temperature: jax.Array  # float32 []
    top_p: jax.Array  # float32 []
    top_k: jax.Array  # int32 []
    eos_e: jax.Array  # int32 [E]: the end tokens (one array: every loop that reads it, once)
    size_g: jax.Array  # int32 [P]: each prompt's rollouts (its group)
    part_g: jax.Array  # int32 [P]: the process whose prompt it is
    quota: jax.Array  # int32 [parts]: whole groups each part needs for the exit test


class Slots(NamedTuple):
    """The rows being decoded, one entry per slot (S of them, or B in a rung): its rollout, and
    that rollout's completion so far (written back to the outputs by rollout, `flush`, when the
    slot changes hands or the rows move)."""

    rollout_s: jax.Array  # int32 [S]: the rollout in the slot
    age_s: jax.Array  # int32 [S]: its tokens sampled so far
    last_s: jax.Array  # int32 [S]: its last token (the next iteration's input)
    live_s: jax.Array  # bool [S]: still running
    ended_s: jax.Array  # bool [S]: an end-of-sequence token came
    tokens_sl: jax.Array  # int32 [S, L]: its tokens, pad_id after its age
    logprobs_sl: jax.Array  # float32 [S, L]: their log-probabilities, 0 after its age


class Run(NamedTuple):
    """What the decode carries besides the cache: the slots, the outputs by rollout, the queue,
    the counters."""

    slots: Slots
    tokens_nl: jax.Array  # int32 [N, L]: completions written out (`flush`)
    logprobs_nl: jax.Array  # float32 [N, L]
    lengths_n: jax.Array  # int32 [N]: tokens sampled
    ended_n: jax.Array  # bool [N]: an end-of-sequence token came
    waiting: jax.Array  # int32 []: the next rollout to start (N: none waits)
    steps: jax.Array  # int32 []: decode iterations run
    rows: jax.Array  # int32 []: rows decoded, summed over the iterations
    done_g: jax.Array  # int32 [P]: rollouts of each prompt done (counted with keep_groups only)


# ---------------------------------------------------------------------------- the cache


def constrain(plan: ShardingPlan | None, cache: KVCache) -> KVCache:
    """``cache`` split as the plan says (rows and KV heads); as it is without a plan."""
    if plan is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, plan.cache(cache))


def empty_cache(config: DecoderConfig, plan: ShardingPlan | None, rows: int, slots: int) -> KVCache:
    """A zero cache of ``slots`` slots for ``rows`` rows with a per-row write index, split as
    the plan says."""
    cache = init_cache(config, rows, slots)
    return constrain(plan, cache._replace(index=jnp.zeros((rows,), jnp.int32)))


def grow(ctx: Context, cache: KVCache, slots: int) -> KVCache:
    """``cache`` with a zero block appended up to ``slots`` slots (the next phase's cache): the
    slots already written stay where they are, nothing is copied (slots past a row's index are
    masked, so their content is never read)."""
    zero = init_cache(ctx.config, cache.start_b.shape[0], slots - cache.slots)
    return constrain(
        ctx.plan,
        cache._replace(
            k_lbkhs=tuple(
                (*cache_blocks(k), z) for k, z in zip(cache.k_lbkhs, zero.k_lbkhs, strict=True)
            ),
            v_lbksh=tuple(
                (*cache_blocks(v), z) for v, z in zip(cache.v_lbksh, zero.v_lbksh, strict=True)
            ),
        ),
    )


def joined(ctx: Context, cache: KVCache, slots: int) -> KVCache:
    """``cache`` as one array per layer of ``slots`` slots: its blocks, then zeros."""
    zero = init_cache(ctx.config, cache.start_b.shape[0], slots - cache.slots)
    return constrain(
        ctx.plan,
        cache._replace(
            k_lbkhs=tuple(
                jnp.concatenate((*cache_blocks(k), z), axis=3)
                for k, z in zip(cache.k_lbkhs, zero.k_lbkhs, strict=True)
            ),
            v_lbksh=tuple(
                jnp.concatenate((*cache_blocks(v), z), axis=2)
                for v, z in zip(cache.v_lbksh, zero.v_lbksh, strict=True)
            ),
        ),
    )


def _in_first_block(x, update):
    """A layer's keys or values with ``update`` applied to their first block (a prompt's slots,
    which the first phase's cache holds)."""
    if not isinstance(x, tuple):
        return update(x)
    return (update(x[0]), *x[1:])


def _take_rows(tree, idx):
    return jax.tree.map(lambda x: x[idx], tree)


def _take_shard_rows(tree, order_hk):
    """``tree``'s leaves (rows first, split into h equal shards, one per device) with rows
    ``order_hk[i]`` of shard i, shard by shard: a gather within each device's rows, with no
    data moved between devices."""
    shards, keep = order_hk.shape

    def take(x):
        x_hb = x.reshape(shards, -1, *x.shape[1:])
        return jax.vmap(lambda rows, idx: rows[idx])(x_hb, order_hk).reshape(-1, *x.shape[1:])

    return jax.tree.map(take, tree)


# ------------------------------------------------------------------ prompts and tokens


def prefill(
    ctx: Context, state, prompt_ids_pt, start_p, prompt_index_r, key, temperature, top_p, top_k
) -> Inputs:
    """The call's `Inputs`: one prefill per prompt (prompt_ids_pt int32 [P, T], left-padded,
    prompt p from slot start_p[p]), and the exit test's tables (every process's prompts, its
    part of the prompt table, need keep_groups groups whose rollouts are all done)."""
    model = nnx.merge(ctx.graphdef, state)
    prompt_cache = init_cache(ctx.config, ctx.prompts, ctx.prompt_len, start_b=start_p)
    logits_p1v, prompt_cache = model.apply_cached(prompt_ids_pt, prompt_cache, last_only=True)
    part_g = jnp.arange(ctx.prompts) // (ctx.prompts // ctx.parts)
    size_g = jax.ops.segment_sum(jnp.ones((ctx.rollouts,), jnp.int32), prompt_index_r, ctx.prompts)
    quota = jnp.minimum(
        ctx.keep_groups, jax.ops.segment_sum((size_g > 0).astype(jnp.int32), part_g, ctx.parts)
    )
    return Inputs(
        model=model,
        prompt_index_r=prompt_index_r,
        start_p=start_p,
        logits_pv=logits_p1v[:, 0],
        prompt_cache=prompt_cache,
        key=key,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_e=jnp.asarray(ctx.eos_ids, jnp.int32).reshape(-1),
        size_g=size_g,
        part_g=part_g,
        quota=quota,
    )


def is_eos(inputs: Inputs, token_b) -> jax.Array:
    """bool [B]: the tokens that end their rows."""
    return jnp.any(token_b[:, None] == inputs.eos_e[None, :], axis=-1)


def draw(inputs: Inputs, logits_bv, rollout_b, age_b):
    """(token int32 [B], log-probability float32 [B]): token ``age_b`` of rollouts
    ``rollout_b``, each from its own stream."""
    keys_b = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(inputs.key, r), t))(
        rollout_b, age_b
    )
    return sample_token(logits_bv, keys_b, inputs.temperature, inputs.top_p, inputs.top_k)


def prompt_of(ctx: Context, inputs: Inputs, rollout_b) -> jax.Array:
    """int32 [B]: the prompts of rollouts ``rollout_b`` (N, no rollout, reads the last's)."""
    return inputs.prompt_index_r[jnp.minimum(rollout_b, ctx.rollouts - 1)]


# ------------------------------------------------------------- outputs and the exit test


def count_done(ctx: Context, run: Run, done_b, prompt_b) -> Run:
    """``run`` with the rollouts of prompts ``prompt_b`` [B] where ``done_b`` [B] counted as
    done (only with keep_groups)."""
    if not ctx.keep_groups:
        return run
    done = jax.ops.segment_sum(done_b.astype(jnp.int32), prompt_b, ctx.prompts)
    return run._replace(done_g=run.done_g + done)


def enough(ctx: Context, inputs: Inputs, run: Run) -> jax.Array:
    """bool []: the exit test of keep_groups: every part of the prompt table has its quota of
    groups whose rollouts are all done."""
    whole_g = (run.done_g == inputs.size_g) & (inputs.size_g > 0)
    done_parts = jax.ops.segment_sum(whole_g.astype(jnp.int32), inputs.part_g, ctx.parts)
    return jnp.all(done_parts >= inputs.quota)


def flush(ctx: Context, run: Run, slots: Slots, valid_s=None) -> Run:
    """``run`` with the slots' completions written to their rollouts' outputs (where valid_s)."""
    r_s = slots.rollout_s if valid_s is None else jnp.where(valid_s, slots.rollout_s, ctx.rollouts)
    return run._replace(
        tokens_nl=run.tokens_nl.at[r_s].set(slots.tokens_sl, mode="drop"),
        logprobs_nl=run.logprobs_nl.at[r_s].set(slots.logprobs_sl, mode="drop"),
        lengths_n=run.lengths_n.at[r_s].set(slots.age_s, mode="drop"),
        ended_n=run.ended_n.at[r_s].set(slots.ended_s, mode="drop"),
    )


# ------------------------------------------------------------------ rollouts into slots


def empty_run(ctx: Context) -> Run:
    """A run before any start: empty slots and outputs, the queue at the first rollout past
    the slots, the counters at 0."""
    zeros_s = jnp.zeros((ctx.slots,), jnp.int32)
    return Run(
        slots=Slots(
            *(zeros_s,) * 3,
            *(jnp.zeros((ctx.slots,), bool),) * 2,
            jnp.full((ctx.slots, ctx.length), ctx.pad_id, jnp.int32),
            jnp.zeros((ctx.slots, ctx.length), jnp.float32),
        ),
        tokens_nl=jnp.full((ctx.rollouts, ctx.length), ctx.pad_id, jnp.int32),
        logprobs_nl=jnp.zeros((ctx.rollouts, ctx.length), jnp.float32),
        lengths_n=jnp.zeros((ctx.rollouts,), jnp.int32),
        ended_n=jnp.zeros((ctx.rollouts,), bool),
        waiting=jnp.asarray(ctx.slots, jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        rows=jnp.zeros((), jnp.int32),
        done_g=jnp.zeros((ctx.prompts,), jnp.int32),
    )


def start(
    ctx: Context, inputs: Inputs, cache: KVCache, run: Run, slot_j, rollout_j, valid_j, first=False
) -> tuple[KVCache, Run]:
    """Rollouts ``rollout_j`` take slots ``slot_j`` where ``valid_j`` (their occupants'
    completions written out first, unless ``first``: slot_j is every slot in order, all valid):
    their prompts' keys and values copied into the slots' first cache block, their first tokens
    drawn from their prompts' logits. Returns (cache, run)."""
    num_slots, prompt_len = ctx.slots, ctx.prompt_len
    s_j = jnp.where(valid_j, slot_j, num_slots)  # invalid ones dropped
    if not first:
        leaving = _take_rows(run.slots, jnp.minimum(slot_j, num_slots - 1))
        run = flush(ctx, run, leaving, valid_j)
    prompt_j = prompt_of(ctx, inputs, rollout_j)
    if first and ctx.plan is not None:  # slot j's prompt on the device of slot j
        prompt_j = jax.lax.with_sharding_constraint(prompt_j, ctx.plan.rows)
    token_j, logprob_j = draw(
        inputs, inputs.logits_pv[prompt_j], rollout_j, jnp.zeros_like(rollout_j)
    )

    def copy_in(x, prompt_x, slots_axis: int):
        """A layer's keys or values with the prompts' in the slots s_j. The first start fills
        every slot in order: a slice, not a scatter, so that each device gathers only its own
        rows' prompts (a scatter at indices known to every device materialises every slot's
        prompt on every device)."""
        rows = s_j if not first else slice(None)
        at = (rows, *(slice(None),) * (slots_axis - 1), slice(0, prompt_len))
        return _in_first_block(x, lambda b: b.at[at].set(prompt_x[prompt_j], mode="drop"))

    prompts = inputs.prompt_cache
    cache = constrain(
        ctx.plan,
        KVCache(
            k_lbkhs=tuple(
                copy_in(k, pk, 3) for k, pk in zip(cache.k_lbkhs, prompts.k_lbkhs, strict=True)
            ),
            v_lbksh=tuple(
                copy_in(v, pv, 2) for v, pv in zip(cache.v_lbksh, prompts.v_lbksh, strict=True)
            ),
            start_b=cache.start_b.at[s_j].set(inputs.start_p[prompt_j], mode="drop"),
            index=cache.index,
        ),
    )
    ended_j = is_eos(inputs, token_j)
    first_l = jnp.arange(ctx.length) == 0
    new = Slots(
        rollout_s=rollout_j,
        age_s=jnp.ones_like(rollout_j),
        last_s=token_j,
        live_s=~ended_j & (ctx.length > 1),
        ended_s=ended_j,
        tokens_sl=jnp.where(first_l[None, :], token_j[:, None], ctx.pad_id),
        logprobs_sl=jnp.where(first_l[None, :], logprob_j[:, None], 0.0),
    )
    if first:  # every slot, in order
        slots = new
    else:
        slots = jax.tree.map(lambda x, y: x.at[s_j].set(y, mode="drop"), run.slots, new)
    run = count_done(ctx, run, valid_j & ~new.live_s, prompt_j)
    return cache, run._replace(slots=slots)


def refill(ctx: Context, inputs: Inputs, cache: KVCache, run: Run) -> tuple[KVCache, Run]:
    """Free slots take waiting rollouts, ``ctx.refill_width`` at a time, until none is free or
    none waits (a rollout that ends at its first token frees its slot again)."""
    n, num_slots, width = ctx.rollouts, ctx.slots, ctx.refill_width

    def free(carry):
        return jnp.any(~carry[1].slots.live_s) & (carry[1].waiting < n)

    def one(carry):
        cache, run = carry
        slot_j = jnp.nonzero(~run.slots.live_s, size=width, fill_value=num_slots)[0]
        rollout_j = run.waiting + jnp.arange(width, dtype=jnp.int32)
        valid_j = (slot_j < num_slots) & (rollout_j < n)
        cache, run = start(ctx, inputs, cache, run, slot_j, rollout_j, valid_j)
        return cache, run._replace(waiting=run.waiting + jnp.sum(valid_j, dtype=jnp.int32))

    return jax.lax.while_loop(free, one, (cache, run))


def first_start(ctx: Context, inputs: Inputs) -> tuple[KVCache, Run]:
    """The state the decode starts from: the slots take their first rollouts
    (`schedule.first_rollouts`: a group's spread over the shards) in a first phase's cache; with
    rollouts waiting, the slots of those that ended at their first token are refilled at once."""
    cache = empty_cache(ctx.config, ctx.plan, ctx.slots, ctx.prompt_len + ctx.caps[0])
    slot_s = jnp.arange(ctx.slots, dtype=jnp.int32)
    first_s = jnp.asarray(first_rollouts(ctx.slots, ctx.shards), jnp.int32)
    every_s = jnp.ones((ctx.slots,), bool)
    cache, run = start(ctx, inputs, cache, empty_run(ctx), slot_s, first_s, every_s, True)
    if ctx.refilling:
        cache, run = refill(ctx, inputs, cache, run)
    return cache, run


# -------------------------------------------------------------------------- the decode


def status(ctx: Context, inputs: Inputs, slots: Slots, run: Run, cap: int):
    """(rows a rung needs, running rows of age > cap), int32 [] each. Rows are compacted within
    each device's shard, so a rung needs the running rows of the fullest shard on every shard
    (0 once no row runs, or once the exit test holds). The shards' counts meet in one
    all-gather: the one collective an iteration's loop condition needs when rows are split over
    devices (none in lockstep)."""
    shards = ctx.shards
    if ctx.lockstep:
        age = run.steps + 1
        n = ctx.rollouts
        live, over = jnp.where(age < ctx.length, n, 0), jnp.where(age > cap, n, 0)
    else:
        counts = jnp.stack([slots.live_s, slots.live_s & (slots.age_s > cap)], axis=-1)
        counts_h2 = jnp.sum(counts.astype(jnp.int32).reshape(shards, -1, 2), axis=1)
        if ctx.plan is not None:
            counts_h2 = jax.lax.with_sharding_constraint(counts_h2, ctx.plan.replicated)
        live, over = jnp.max(counts_h2[:, 0]) * shards, jnp.sum(counts_h2[:, 1])
    if ctx.keep_groups:  # stopped by the exit test: every stage sees no row running
        live = jnp.where(enough(ctx, inputs, run), 0, live)
    return live, over


def iterate(
    ctx: Context, inputs: Inputs, cache: KVCache, slots: Slots, run: Run, cap: int
) -> tuple[KVCache, Slots, Run]:
    """One decode iteration of the rows in ``slots`` (a rung), each at its own cache position
    (all at one when every rollout started together), in a cache of ``prompt_len + cap`` slots:
    running rows sample their next token and stop at an end token or the cap. Returns (cache,
    slots, run), run's counters updated."""
    length, pad = ctx.length, ctx.pad_id
    if not ctx.refilling:  # every rollout started together: running rows share their age
        index = ctx.prompt_len + run.steps  # one write slot for all (a cheaper update)
    else:
        index = jnp.minimum(ctx.prompt_len + slots.age_s - 1, ctx.prompt_len + cap - 1)
    logits_b1v, written = inputs.model.apply_cached(
        slots.last_s[:, None], cache._replace(index=index)
    )
    cache = written._replace(index=cache.index)
    token_b, logprob_b = draw(inputs, logits_b1v[:, 0], slots.rollout_s, slots.age_s)
    live_b = slots.live_s
    write_bl = live_b[:, None] & (jnp.arange(length)[None, :] == slots.age_s[:, None])
    eos_b = is_eos(inputs, token_b)
    slots = Slots(
        rollout_s=slots.rollout_s,
        age_s=slots.age_s + live_b.astype(jnp.int32),
        last_s=jnp.where(live_b, token_b, pad),
        live_s=live_b & ~eos_b & (slots.age_s + 1 < length),
        ended_s=slots.ended_s | (live_b & eos_b),
        tokens_sl=jnp.where(write_bl, token_b[:, None], slots.tokens_sl),
        logprobs_sl=jnp.where(write_bl, logprob_b[:, None], slots.logprobs_sl),
    )
    run = run._replace(steps=run.steps + 1, rows=run.rows + live_b.shape[0])
    run = count_done(ctx, run, live_b & ~slots.live_s, prompt_of(ctx, inputs, slots.rollout_s))
    return cache, slots, run


def iterations(
    ctx: Context,
    inputs: Inputs,
    cache: KVCache,
    slots: Slots,
    run: Run,
    cap: int,
    more: Callable[[jax.Array, Run], jax.Array],
    refilling: bool,
) -> tuple[KVCache, Slots, Run]:
    """Iterations (`iterate`) while ``more(running rows, run)`` holds and some row runs, every
    one with room in the cache; `refill` after each when ``refilling``."""

    def going(carry):
        _, slots, run = carry
        live, over = status(ctx, inputs, slots, run, cap)
        return (live > 0) & (over == 0) & more(live, run)

    def step(carry):
        cache, slots, run = iterate(ctx, inputs, *carry, cap)
        if refilling:
            cache, run = refill(ctx, inputs, cache, run._replace(slots=slots))
            slots = run.slots
        return cache, slots, run

    return jax.lax.while_loop(going, step, (cache, slots, run))


def gather(
    ctx: Context, inputs: Inputs, cache: KVCache, slots: Slots, run: Run, rows: int, width: int
) -> tuple[KVCache, Slots, Run]:
    """Every row's completion written out, then, within each shard, its running rows (stable,
    in slot order) and finished ones into ``rows / shards`` rows; the cache joined to ``width``
    slots (an empty one when no row runs: the rest of the tail then only checks that none
    does). Returns (the rung's cache, its slots, run)."""
    shards = ctx.shards
    live, _ = status(ctx, inputs, slots, run, ctx.length)
    keep = rows // shards

    def take():
        live_hb = slots.live_s.reshape(shards, -1)
        order_hk = jnp.argsort(~live_hb, axis=1, stable=True)[:, :keep]
        part = joined(ctx, constrain(ctx.plan, _take_shard_rows(cache, order_hk)), width)
        return part, _take_shard_rows(slots, order_hk)

    def empty():
        first_hk = jnp.broadcast_to(jnp.arange(keep), (shards, keep))
        return empty_cache(ctx.config, ctx.plan, rows, width), _take_shard_rows(slots, first_hk)

    part, kept = jax.lax.cond(live > 0, take, empty)
    return part, kept, flush(ctx, run, slots)


def in_tail(ctx: Context, live, run: Run) -> jax.Array:
    """bool []: no rollout waits and the ``live`` running rows fit the first smaller rung."""
    return (run.waiting >= ctx.rollouts) & (live <= ctx.rungs[min(1, len(ctx.rungs) - 1)])


def all_slots(ctx: Context, inputs: Inputs, cache: KVCache, run: Run):
    """The phases at all slots, one after another, until the rows leave for the tail. Returns
    (tail cache, tail slots, run): rungs[1] rows in a cache of full width; without a tail, the
    run alone, every completion written out. The phases run in sequence, not nested in
    conditionals: a conditional's operands stay allocated while it runs, so nesting would hold
    every phase's cache at once. A phase appends a block to the cache (`grow`), so once no row
    runs, or the rows are in the tail, a later phase costs only its zero block and a test of
    its loop."""
    if ctx.tail:
        keep = lambda live, run: ~in_tail(ctx, live, run)  # noqa: E731
    else:
        keep = lambda *_: True  # noqa: E731
    slots = run.slots
    for phase, cap in enumerate(ctx.caps):
        if phase:
            cache = grow(ctx, cache, ctx.prompt_len + cap)
        cache, slots, run = iterations(ctx, inputs, cache, slots, run, cap, keep, ctx.refilling)
        run = run._replace(slots=slots)
    if ctx.tail:
        return gather(ctx, inputs, cache, slots, run, ctx.rungs[1], ctx.full_width)
    return flush(ctx, run, slots)


def rung(ctx: Context, inputs: Inputs, k: int, cache: KVCache, slots: Slots, run: Run) -> Run:
    """Rungs k, k + 1, ... of the tail (Python recursion: unrolled in the trace), the rows of
    ``slots`` in a cache of full width; the live count only falls, so the rungs are visited in
    order, and the rest is skipped once no row runs. Returns the run, every completion written
    out."""
    rungs = ctx.rungs
    smaller = rungs[k + 1] if k + 1 < len(rungs) else 0
    more = lambda live, run: live > smaller  # noqa: E731
    cache, slots, run = iterations(ctx, inputs, cache, slots, run, ctx.length, more, False)
    if not smaller:
        return flush(ctx, run, slots)
    live, _ = status(ctx, inputs, slots, run, ctx.length)
    return jax.lax.cond(
        live > 0,
        lambda: rung(
            ctx, inputs, k + 1, *gather(ctx, inputs, cache, slots, run, smaller, ctx.full_width)
        ),
        lambda: flush(ctx, run, slots),
    )


def decode(ctx: Context, inputs: Inputs, cache: KVCache, run: Run) -> Run:
    """Every rollout decoded from the state `first_start` returns (or until the exit test
    holds): the phases at all slots, then the tail's rungs. Returns the run, every completion
    written out."""
    if not ctx.tail:
        return all_slots(ctx, inputs, cache, run)
    cache, slots, run = all_slots(ctx, inputs, cache, run)
    live, _ = status(ctx, inputs, slots, run, ctx.length)
    return jax.lax.cond(
        live > 0, lambda: rung(ctx, inputs, 1, cache, slots, run), lambda: flush(ctx, run, slots)
    )
