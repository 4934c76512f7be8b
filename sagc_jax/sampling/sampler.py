"""Generation that decodes only the rows still running: one prefill per prompt, N rollouts
streamed through S slots (rows), finished rows leaving the batch (see ``schedule`` for the
exact order of events, which `schedule.simulate` replays without a model).

- Prefill: each distinct prompt once ([P, prompt bucket]); a rollout's slot gets a copy of its
  prompt's cache and draws its first token from its prompt's last logits.
- Decode: every iteration decodes the rows of the current rung, one token each, each row at its
  own cache position (the cache index is per row). With rollouts waiting, all S slots decode
  and a finished slot takes the next waiting rollout at once. With none waiting, the running
  rows are gathered into the smallest rung of `schedule.row_rungs` that holds them as soon as
  they fit one (static sizes: one branch of the program each).
- The cache grows in phases (`schedule.phase_slots`) so an iteration attends over about the
  tokens so far: a phase appends a block of slots (a layer's keys and values are a tuple of
  blocks, see `KVCache`), so no slot already written is copied. The rows of the smaller rungs
  (the tail) decode over one array of full width.

Phases and rungs are unrolled in one trace: one compiled program per (rollouts, slots, prompts,
prompt bucket, max_new_tokens). The model is split into graphdef (static) and state (arrays),
and the key and temperature / top_p / top_k are arrays, so new prompts, seeds or settings reuse
the program.

Random stream: token t of rollout r draws with ``fold_in(fold_in(key, r), t)``, so a rollout's
tokens depend on the key, its index and its prompt only, not on the slots, the rungs or
which rows shared its iterations (nor on the processes of a multi-process run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sagc_jax.models import Decoder, DecoderConfig, KVCache, init_cache
from sagc_jax.models.layers import cache_blocks
from sagc_jax.parallel import ShardingPlan
from sagc_jax.sampling.functions import sample_token
from sagc_jax.sampling.schedule import (
    REFILL_SHARE,
    first_rollouts,
    phase_slots,
    resolve_chunk,
    row_rungs,
)


class SampleOutput(NamedTuple):
    """What `Sampler.__call__` returns (N rollouts, L = max_new_tokens).

    tokens_bt: int32 [N, L] completion tokens, pad_id after each rollout's end.
    logprobs_bt: float32 [N, L] log-probability of each token under the policy (see
        `sample_token`), 0 after each rollout's end.
    lengths_b: int32 [N] completion lengths, the end-of-sequence token included.
    truncated_b: bool [N] True where no end-of-sequence token came within L tokens.
    num_decode_steps: int32 [] decode iterations run.
    rows_decoded: int32 [] rows decoded, summed over the iterations (the slots they used).
    live_rows_decoded: int32 [] of those, rows still running; the rest is padding.
    prefill_rows: int32 [] prompts prefilled (one per distinct prompt).
    cut_b: bool [N] rollouts the exit test of ``keep_groups`` stopped (running or not started:
        their lengths are what they reached, a lower bound); all False without it.
    """

    tokens_bt: jax.Array
    logprobs_bt: jax.Array
    lengths_b: jax.Array
    truncated_b: jax.Array
    num_decode_steps: jax.Array
    rows_decoded: jax.Array
    live_rows_decoded: jax.Array
    prefill_rows: jax.Array
    cut_b: jax.Array


def _setting(value, dtype):
    """A sampling setting as the program takes it: a jax array as it is (cast if needed), a
    number as a numpy scalar, which the call transfers with its arguments (``jnp.asarray`` of a
    Python number runs a conversion program of its own: three per call)."""
    if isinstance(value, jax.Array):
        return jnp.asarray(value, dtype)
    return np.asarray(value, dtype)


class _Slots(NamedTuple):
    """The rows being decoded, one entry per slot: its rollout, and that rollout's completion so
    far (written back to the outputs by rollout when the slot changes hands or the rows move)."""

    rollout_s: jax.Array  # int32: the rollout in the slot
    age_s: jax.Array  # int32: its tokens sampled so far
    last_s: jax.Array  # int32: its last token (the next iteration's input)
    live_s: jax.Array  # bool: still running
    ended_s: jax.Array  # bool: an end-of-sequence token came
    tokens_sl: jax.Array  # int32 [S, L]
    logprobs_sl: jax.Array  # float32 [S, L]


class _Run(NamedTuple):
    """What the decode carries besides the cache: outputs by rollout, the queue, counters."""

    slots: _Slots
    tokens_nl: jax.Array
    logprobs_nl: jax.Array
    lengths_n: jax.Array
    ended_n: jax.Array
    waiting: jax.Array  # int32 []: the next rollout to start (N: none waits)
    steps: jax.Array
    rows: jax.Array
    done_g: jax.Array  # int32 [P]: rollouts of each prompt done (counted with keep_groups only)


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


class Sampler:
    """Generates completions from a `Decoder` split as (graphdef, state).

    eos_ids: tokens that end a row (default: config.eos_ids); empty means never stop early.
    pad_id: the token written after a row's end (and expected in prompt padding).
    decode_chunk: cache slots added per decode phase (see `schedule.resolve_chunk`); 0: one
        phase over the whole cache.
    slots: rows decoded at once (0: every rollout of the call); fewer than the rollouts streams
        them through the slots. row_buckets: rungs of `schedule.row_rungs` (1: every
        iteration decodes all slots). Tokens depend on none of these.
    plan, state_shardings: a `ShardingPlan` and the shardings of `state` (FSDP / tensor / data
        parallel, several processes): the program is jitted with those input and output
        shardings, rollouts and slots split over the plan's batch axes, the KV cache over rows
        and KV heads, prompts replicated. Calls then take each process's own prompts and
        rollouts (numpy) and return global arrays; `to_host` gives each process its rows back.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: DecoderConfig,
        *,
        eos_ids: Sequence[int] | None = None,
        pad_id: int = 0,
        decode_chunk: int | str = "auto",
        slots: int = 0,
        row_buckets: int = 6,
        plan: ShardingPlan | None = None,
        state_shardings=None,
    ):
        if plan is not None and state_shardings is None:
            raise ValueError("Sampler: plan needs state_shardings (e.g. plan.params(state))")
        resolve_chunk(1, decode_chunk)  # raises early on a bad value
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"Sampler: slots={slots!r}; use an int >= 0 (0: every rollout)")
        if isinstance(row_buckets, bool) or not isinstance(row_buckets, int) or row_buckets < 1:
            raise ValueError(f"Sampler: row_buckets={row_buckets!r}; use an int >= 1")
        self.graphdef = graphdef
        self.config = config
        self.eos_ids = tuple(config.eos_ids if eos_ids is None else eos_ids)
        self.pad_id = int(pad_id)
        self.decode_chunk = decode_chunk
        self.slots = slots
        self.row_buckets = row_buckets
        self.plan = plan
        self.shards = plan.batch_shards if plan is not None else 1
        self.num_traces = 0  # incremented each time the generation program is traced
        jit_kw = {}
        self._decode_shardings = None
        if plan is not None and plan.mesh.shape["fsdp"] > 1:
            self._decode_shardings = plan.for_decoding(state_shardings)
        if plan is not None:
            rows, scalar = plan.rows, plan.replicated
            jit_kw = dict(
                in_shardings=(state_shardings, scalar, scalar, rows, *(scalar,) * 4),
                out_shardings=SampleOutput(rows, rows, rows, rows, *(scalar,) * 4, rows),
            )
        # max_new_tokens, slots and keep_groups (last, static) are positional: jit takes no
        # keywords with shardings.
        self._generate = jax.jit(self._generate_impl, static_argnums=(8, 9, 10), **jit_kw)

    @classmethod
    def from_model(cls, model: Decoder, **kwargs) -> tuple[Sampler, nnx.State]:
        """(sampler, state) for `model`: call `sampler(state, ...)`."""
        graphdef, state = nnx.split(model)
        return cls(graphdef, model.config, **kwargs), state

    def compiled_programs(self) -> int:
        """Programs this sampler has traced and compiled (one per shape of a call). Counted per
        instance: the jit cache of a method is shared by all instances."""
        return self.num_traces

    def slots_for(self, rollouts: int) -> int:
        """Slots a call of ``rollouts`` rollouts (all processes') decodes through."""
        slots = min(self.slots or rollouts, rollouts)
        if slots % self.shards:
            raise ValueError(
                f"sampling.slots = {slots} rows do not split into the mesh's {self.shards} "
                f"batch shards; use a multiple of {self.shards}"
            )
        return slots

    def empty_cache(self, batch: int, slots: int) -> KVCache:
        """A zero cache of `slots` slots for `batch` rows, split as the plan says (rows and KV
        heads), with a per-row write index, as the program allocates it for its first phase."""
        cache = init_cache(self.config, batch, slots)
        return self._constrain(cache._replace(index=jnp.zeros((batch,), jnp.int32)))

    def compile(self, *args, **kwargs) -> jax.stages.Compiled:
        """Compiles the program for ``rollouts`` rollouts (all processes') of ``prompts`` distinct
        prompts (default: one each) padded to ``prompt_len``, without running it (arguments as
        `lower`'s); the next call of that shape reuses the executable (no recompile). Returns it
        (``.as_text()``: its optimised HLO)."""
        return self.lower(*args, **kwargs).compile()

    def lower(
        self,
        state: nnx.State,
        rollouts: int,
        prompt_len: int,
        *,
        max_new_tokens: int,
        prompts: int | None = None,
        keep_groups: int = 0,
    ) -> jax.stages.Lowered:
        """The program `compile` compiles, lowered (``state``: arrays or ShapeDtypeStructs with
        shardings, e.g. for devices that are only described: ``planning.aot``)."""

        # Shapes with the shardings a real call has (they are part of the cache key): an
        # uncommitted array (one device, no plan) has none, or the call compiles once more.
        def spec(x):
            committed = self.plan is not None or getattr(x, "committed", False)
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=x.sharding if committed else None
            )

        plan = self.plan
        rows = plan.rows if plan is not None else None
        whole = plan.replicated if plan is not None else None
        prompts = rollouts if prompts is None else prompts
        return self._generate.lower(
            jax.tree.map(spec, state),
            jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=whole),
            jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=whole),
            jax.ShapeDtypeStruct((rollouts,), jnp.int32, sharding=rows),
            jax.random.key(0),  # (scalars are passed uncommitted, as in a real call)
            jnp.float32(1.0),
            jnp.float32(1.0),
            jnp.int32(0),
            max_new_tokens,
            self.slots_for(rollouts),
            keep_groups,
        )

    def __call__(
        self,
        state: nnx.State,
        prompt_ids_bt,
        prompt_lens_b,
        key: jax.Array,
        *,
        max_new_tokens: int,
        prompt_index_r=None,
        temperature: float | jax.Array = 1.0,
        top_p: float | jax.Array = 1.0,
        top_k: int | jax.Array = 0,
        keep_groups: int = 0,
    ) -> SampleOutput:
        """Samples up to `max_new_tokens` tokens for each rollout.

        prompt_ids_bt: int32 [P, width], prompt p in its last prompt_lens_b[p] columns
            (`left_pad` builds it with width a bucket); prompt_lens_b: int32 [P], each >= 1.
        prompt_index_r: int [N], the prompt of each rollout (rollouts of a prompt share its one
            prefill); None: one rollout per prompt. With a plan: this process's prompts and
            rollouts, indices into its own prompts (every process passes as many).
        temperature <= 0 is greedy; top_k <= 0 and top_p >= 1 disable those filters.
        keep_groups > 0 (tail batching): stop as soon as every process has that many groups (the
            rollouts of one prompt) whose rollouts have all finished; the others come back cut
            (`SampleOutput.cut_b`). One more program per value (0: decode every rollout).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}; must be >= 1")
        # [P, width] token ids: a float array would be cast to ids without an error
        chex.assert_rank(prompt_ids_bt, 2)
        chex.assert_type(prompt_ids_bt, int)
        num_prompts, prompt_len = np.shape(prompt_ids_bt)
        lens_p = np.asarray(prompt_lens_b, np.int32)
        if lens_p.shape != (num_prompts,) or lens_p.min() < 1 or lens_p.max() > prompt_len:
            raise ValueError(
                f"prompt_lens_b {lens_p.tolist()} must have shape ({num_prompts},) and values in "
                f"[1, {prompt_len}] for prompt_ids_bt of shape {np.shape(prompt_ids_bt)}"
            )
        if prompt_index_r is None:
            index_r = np.arange(num_prompts, dtype=np.int32)
        else:
            index_r = np.asarray(prompt_index_r)
            if (
                index_r.ndim != 1
                or index_r.size == 0
                or not np.issubdtype(index_r.dtype, np.integer)
            ):
                raise ValueError(
                    f"prompt_index_r must be a non-empty 1-D integer array, got shape "
                    f"{index_r.shape} of {index_r.dtype}"
                )
            if index_r.min() < 0 or index_r.max() >= num_prompts:
                raise ValueError(
                    f"prompt_index_r holds {int(index_r.min())}..{int(index_r.max())}; each must "
                    f"index one of the {num_prompts} prompts of prompt_ids_bt"
                )
            index_r = index_r.astype(np.int32)
        ids_pt = np.asarray(prompt_ids_bt, np.int32)
        start_p = np.asarray(prompt_len - lens_p, np.int32)  # first cache slot of each prompt
        plan = self.plan
        if plan is not None:  # every process's prompts (replicated), its rollouts (rows)
            from sagc_jax.parallel import gather_rows

            offset = jax.process_index() * num_prompts  # this process's prompts in the table
            ids_pt, start_p = gather_rows(ids_pt), gather_rows(start_p)
            ids_pt, start_p = (jax.device_put(x, plan.replicated) for x in (ids_pt, start_p))
            index_r = plan.global_rows(index_r + np.int32(offset))
        else:
            # with a dtype: a plain transfer (without one, jnp.asarray runs a program)
            ids_pt, start_p, index_r = (
                jnp.asarray(x, jnp.int32) for x in (ids_pt, start_p, index_r)
            )
        return self._generate(
            state,
            ids_pt,
            start_p,
            index_r,
            key,
            _setting(temperature, np.float32),
            _setting(top_p, np.float32),
            _setting(top_k, np.int32),
            max_new_tokens,
            self.slots_for(int(index_r.shape[0])),
            int(keep_groups),
        )

    def to_host(self, out: SampleOutput) -> SampleOutput:
        """``out`` as numpy, only this process's rows when the sampler has a plan."""
        if self.plan is not None:
            return self.plan.local_rows(out)
        return jax.device_get(out)

    def _constrain(self, cache: KVCache) -> KVCache:
        if self.plan is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self.plan.cache(cache))

    def _grow(self, cache: KVCache, slots: int) -> KVCache:
        """`cache` with a zero block appended up to `slots` slots (the next phase's cache): the
        slots already written stay where they are, nothing is copied (slots past a row's
        index are masked, so their content is never read)."""
        zero = init_cache(self.config, cache.start_b.shape[0], slots - cache.slots)
        return self._constrain(
            cache._replace(
                k_lbkhs=tuple(
                    (*cache_blocks(k), z) for k, z in zip(cache.k_lbkhs, zero.k_lbkhs, strict=True)
                ),
                v_lbksh=tuple(
                    (*cache_blocks(v), z) for v, z in zip(cache.v_lbksh, zero.v_lbksh, strict=True)
                ),
            )
        )

    def _joined(self, cache: KVCache, slots: int) -> KVCache:
        """`cache` as one array per layer of `slots` slots: its blocks, then zeros."""
        zero = init_cache(self.config, cache.start_b.shape[0], slots - cache.slots)
        return self._constrain(
            cache._replace(
                k_lbkhs=tuple(
                    jnp.concatenate((*cache_blocks(k), z), axis=3)
                    for k, z in zip(cache.k_lbkhs, zero.k_lbkhs, strict=True)
                ),
                v_lbksh=tuple(
                    jnp.concatenate((*cache_blocks(v), z), axis=2)
                    for v, z in zip(cache.v_lbksh, zero.v_lbksh, strict=True)
                ),
            )
        )

    def _generate_impl(self, *args):
        self.num_traces += 1  # Python side effect: runs once per trace, never per call
        with self.plan.activate() if self.plan is not None else contextlib.nullcontext():
            return self._generate_traced(*args)

    def _generate_traced(
        self,
        state,
        prompt_ids_pt,
        start_p,
        prompt_index_r,
        key,
        temperature,
        top_p,
        top_k,
        max_new_tokens,
        num_slots,
        keep_groups,
    ):
        if self._decode_shardings is not None:
            # FSDP: gather the weights (in the compute dtype, which every use casts them to)
            # once, before the prefill, rather than in every step of the decode loop.
            cd = self.config.compute_jnp_dtype
            state = jax.tree.map(
                lambda x, s: jax.lax.with_sharding_constraint(x.astype(cd), s),
                state,
                self._decode_shardings,
            )
        model = nnx.merge(self.graphdef, state)
        num_prompts, prompt_len = prompt_ids_pt.shape
        n, length, pad = prompt_index_r.shape[0], max_new_tokens, self.pad_id
        chunk = resolve_chunk(length, self.decode_chunk)
        caps_p = phase_slots(length, chunk)
        rungs = row_rungs(num_slots, self.row_buckets, self.shards)
        refill_width = max(1, -(-num_slots // REFILL_SHARE))
        eos_e = jnp.asarray(self.eos_ids, jnp.int32).reshape(-1)
        # The exit test of keep_groups: every process's prompts (its part of the prompt table)
        # have keep_groups groups whose rollouts are all done.
        parts = jax.process_count() if self.plan is not None else 1
        part_g = jnp.arange(num_prompts) // (num_prompts // parts)
        size_g = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), prompt_index_r, num_prompts)
        quota = jnp.minimum(
            keep_groups, jax.ops.segment_sum((size_g > 0).astype(jnp.int32), part_g, parts)
        )

        def count_done(run: _Run, done_b, prompt_b) -> _Run:
            """run with the rollouts of prompts ``prompt_b`` where ``done_b`` counted as done."""
            if not keep_groups:
                return run
            done = jax.ops.segment_sum(done_b.astype(jnp.int32), prompt_b, num_prompts)
            return run._replace(done_g=run.done_g + done)

        def enough(run: _Run):
            whole_g = (run.done_g == size_g) & (size_g > 0)
            return jnp.all(jax.ops.segment_sum(whole_g.astype(jnp.int32), part_g, parts) >= quota)

        def is_eos(token_b):
            return jnp.any(token_b[:, None] == eos_e[None, :], axis=-1)

        def draw(logits_bv, rollout_b, age_b):
            keys_b = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(
                rollout_b, age_b
            )
            return sample_token(logits_bv, keys_b, temperature, top_p, top_k)

        def flush(run: _Run, slots: _Slots, valid_s=None) -> _Run:
            """The slots' completions written to their rollouts' outputs (where valid_s)."""
            r_s = slots.rollout_s if valid_s is None else jnp.where(valid_s, slots.rollout_s, n)
            return run._replace(
                tokens_nl=run.tokens_nl.at[r_s].set(slots.tokens_sl, mode="drop"),
                logprobs_nl=run.logprobs_nl.at[r_s].set(slots.logprobs_sl, mode="drop"),
                lengths_n=run.lengths_n.at[r_s].set(slots.age_s, mode="drop"),
                ended_n=run.ended_n.at[r_s].set(slots.ended_s, mode="drop"),
            )

        # One prefill per prompt: its cache is copied into each of its rollouts' slots.
        prompt_cache = init_cache(self.config, num_prompts, prompt_len, start_b=start_p)
        logits_p1v, prompt_cache = model.apply_cached(prompt_ids_pt, prompt_cache, last_only=True)
        logits_pv = logits_p1v[:, 0]

        def start(cache: KVCache, run: _Run, slot_j, rollout_j, valid_j, first=False):
            """Rollouts rollout_j take slots slot_j where valid_j (their occupants' completions
            written out first, unless ``first``: slot_j is every slot in order, all valid):
            their prompts' caches copied in, their first tokens drawn from their prompts'
            logits."""
            s_j = jnp.where(valid_j, slot_j, num_slots)  # invalid ones dropped
            if not first:
                leaving = _take_rows(run.slots, jnp.minimum(slot_j, num_slots - 1))
                run = flush(run, leaving, valid_j)
            prompt_j = prompt_index_r[jnp.minimum(rollout_j, n - 1)]
            if first and self.plan is not None:  # slot j's prompt on the device of slot j
                prompt_j = jax.lax.with_sharding_constraint(prompt_j, self.plan.rows)
            token_j, logprob_j = draw(logits_pv[prompt_j], rollout_j, jnp.zeros_like(rollout_j))

            def copy_in(x, prompt_x, slots_axis: int):
                """A layer's keys or values with the prompts' in the slots s_j. The first start
                fills every slot in order: a slice, not a scatter, so that each device gathers
                only its own rows' prompts (a scatter at indices known to every device
                materialises every slot's prompt on every device)."""
                rows = s_j if not first else slice(None)
                at = (rows, *(slice(None),) * (slots_axis - 1), slice(0, prompt_len))
                return _in_first_block(x, lambda b: b.at[at].set(prompt_x[prompt_j], mode="drop"))

            cache = self._constrain(
                KVCache(
                    k_lbkhs=tuple(
                        copy_in(k, pk, 3)
                        for k, pk in zip(cache.k_lbkhs, prompt_cache.k_lbkhs, strict=True)
                    ),
                    v_lbksh=tuple(
                        copy_in(v, pv, 2)
                        for v, pv in zip(cache.v_lbksh, prompt_cache.v_lbksh, strict=True)
                    ),
                    start_b=cache.start_b.at[s_j].set(start_p[prompt_j], mode="drop"),
                    index=cache.index,
                )
            )
            ended_j = is_eos(token_j)
            first_l = jnp.arange(length) == 0
            new = _Slots(
                rollout_s=rollout_j,
                age_s=jnp.ones_like(rollout_j),
                last_s=token_j,
                live_s=~ended_j & (length > 1),
                ended_s=ended_j,
                tokens_sl=jnp.where(first_l[None, :], token_j[:, None], pad),
                logprobs_sl=jnp.where(first_l[None, :], logprob_j[:, None], 0.0),
            )
            if first:  # every slot, in order
                slots = new
            else:
                slots = jax.tree.map(lambda x, y: x.at[s_j].set(y, mode="drop"), run.slots, new)
            run = count_done(run, valid_j & ~new.live_s, prompt_j)
            return cache, run._replace(slots=slots)

        def refill(cache: KVCache, run: _Run):
            """Free slots take waiting rollouts, refill_width at a time, until none is free or
            none waits (a rollout that ends at its first token frees its slot again)."""

            def free(carry):
                return jnp.any(~carry[1].slots.live_s) & (carry[1].waiting < n)

            def one(carry):
                cache, run = carry
                slot_j = jnp.nonzero(~run.slots.live_s, size=refill_width, fill_value=num_slots)[0]
                rollout_j = run.waiting + jnp.arange(refill_width, dtype=jnp.int32)
                valid_j = (slot_j < num_slots) & (rollout_j < n)
                cache, run = start(cache, run, slot_j, rollout_j, valid_j)
                return cache, run._replace(waiting=run.waiting + jnp.sum(valid_j, dtype=jnp.int32))

            return jax.lax.while_loop(free, one, (cache, run))

        # Without an end-of-sequence token and with every rollout started together, every row
        # runs to the cap: ages are 1 + steps, and counting rows needs no reduction.
        lockstep = not self.eos_ids and n <= num_slots

        shards = self.shards

        def status(slots: _Slots, run: _Run, cap: int):
            """(rows a rung needs, running rows of age > cap). Rows are compacted within each
            device's shard, so a rung needs the running rows of the fullest shard on every
            shard (0 once no row runs). The shards' counts meet in one all-gather: the one
            collective an iteration's loop condition needs when rows are split over devices
            (none in lockstep)."""
            if lockstep:
                age = run.steps + 1
                live, over = jnp.where(age < length, n, 0), jnp.where(age > cap, n, 0)
            else:
                counts = jnp.stack([slots.live_s, slots.live_s & (slots.age_s > cap)], axis=-1)
                counts_h2 = jnp.sum(counts.astype(jnp.int32).reshape(shards, -1, 2), axis=1)
                if self.plan is not None:
                    counts_h2 = jax.lax.with_sharding_constraint(counts_h2, self.plan.replicated)
                live, over = jnp.max(counts_h2[:, 0]) * shards, jnp.sum(counts_h2[:, 1])
            if keep_groups:  # stopped by the exit test: every stage sees no row running
                live = jnp.where(enough(run), 0, live)
            return live, over

        def iterate(cache: KVCache, slots: _Slots, run: _Run, cap: int):
            """One decode iteration of the rows in `slots` (a rung); run's counters updated."""
            if n <= num_slots:  # every rollout started together: running rows share their age
                index = prompt_len + run.steps  # one write slot for all (a cheaper update)
            else:
                index = jnp.minimum(prompt_len + slots.age_s - 1, prompt_len + cap - 1)
            logits_b1v, written = model.apply_cached(
                slots.last_s[:, None], cache._replace(index=index)
            )
            cache = written._replace(index=cache.index)
            token_b, logprob_b = draw(logits_b1v[:, 0], slots.rollout_s, slots.age_s)
            live_b = slots.live_s
            write_bl = live_b[:, None] & (jnp.arange(length)[None, :] == slots.age_s[:, None])
            eos_b = is_eos(token_b)
            slots = _Slots(
                rollout_s=slots.rollout_s,
                age_s=slots.age_s + live_b.astype(jnp.int32),
                last_s=jnp.where(live_b, token_b, pad),
                live_s=live_b & ~eos_b & (slots.age_s + 1 < length),
                ended_s=slots.ended_s | (live_b & eos_b),
                tokens_sl=jnp.where(write_bl, token_b[:, None], slots.tokens_sl),
                logprobs_sl=jnp.where(write_bl, logprob_b[:, None], slots.logprobs_sl),
            )
            run = run._replace(steps=run.steps + 1, rows=run.rows + live_b.shape[0])
            prompt_b = prompt_index_r[jnp.minimum(slots.rollout_s, n - 1)]
            run = count_done(run, live_b & ~slots.live_s, prompt_b)
            return cache, slots, run

        def iterations(cache, slots, run, cap, more, refilling):
            """Iterations while ``more(running rows, run)`` holds and some row runs, every one
            with room in the cache; refill after each when ``refilling``. Returns (cache, slots,
            run)."""

            def going(carry):
                _, slots, run = carry
                live, over = status(slots, run, cap)
                return (live > 0) & (over == 0) & more(live, run)

            def step(carry):
                cache, slots, run = iterate(*carry, cap)
                if refilling:
                    cache, run = refill(cache, run._replace(slots=slots))
                    slots = run.slots
                return cache, slots, run

            return jax.lax.while_loop(going, step, (cache, slots, run))

        def gather(cache: KVCache, slots: _Slots, run: _Run, rows: int, width: int):
            """Every row's completion written out, then, within each shard, its running rows
            (stable) and finished ones into rows / shards rows; the cache padded to `width`
            slots (an empty one when no row runs: the rest of the tail then only checks that
            none does)."""
            live, _ = status(slots, run, length)
            keep = rows // shards

            def take():
                live_hb = slots.live_s.reshape(shards, -1)
                order_hk = jnp.argsort(~live_hb, axis=1, stable=True)[:, :keep]
                part = self._joined(self._constrain(_take_shard_rows(cache, order_hk)), width)
                return part, _take_shard_rows(slots, order_hk)

            def empty():
                first_hk = jnp.broadcast_to(jnp.arange(keep), (shards, keep))
                return self.empty_cache(rows, width), _take_shard_rows(slots, first_hk)

            part, kept = jax.lax.cond(live > 0, take, empty)
            return part, kept, flush(run, slots)

        full_width = prompt_len + length
        tail = len(rungs) > 1

        def in_tail(live, run: _Run):
            """No rollout waits and the ``live`` running rows fit the first smaller rung."""
            return (run.waiting >= n) & (live <= rungs[min(1, len(rungs) - 1)])

        def all_slots(cache: KVCache, run: _Run):
            """The phases at all slots, one after another, until the rows leave for the tail.
            Returns (tail cache, tail slots, run): rungs[1] rows in a cache of full width (run
            alone without a tail). The phases run in sequence, not nested in conditionals: a
            conditional's operands stay allocated while it runs, so nesting would hold every
            phase's cache at once. A phase appends a block to the cache (`_grow`), so once no
            row runs, or the rows are in the tail, a later phase costs only its zero block and
            a test of its loop."""
            keep = (lambda live, run: ~in_tail(live, run)) if tail else (lambda *_: True)
            slots = run.slots
            for phase, cap in enumerate(caps_p):
                if phase:
                    cache = self._grow(cache, prompt_len + cap)
                cache, slots, run = iterations(cache, slots, run, cap, keep, n > num_slots)
                run = run._replace(slots=slots)
            if tail:
                return gather(cache, slots, run, rungs[1], full_width)
            return flush(run, slots)

        def decode(cache: KVCache, run: _Run) -> _Run:
            if not tail:
                return all_slots(cache, run)

            def rung(k: int, cache: KVCache, slots: _Slots, run: _Run) -> _Run:
                """Rungs k, k + 1, ... of the tail (Python recursion: unrolled in the trace);
                the live count only falls, so the rungs are visited in order, and the rest is
                skipped once no row runs."""
                smaller = rungs[k + 1] if k + 1 < len(rungs) else 0
                more = lambda live, run: live > smaller  # noqa: E731
                cache, slots, run = iterations(cache, slots, run, length, more, False)
                if not smaller:
                    return flush(run, slots)
                live, _ = status(slots, run, length)
                return jax.lax.cond(
                    live > 0,
                    lambda: rung(k + 1, *gather(cache, slots, run, smaller, full_width)),
                    lambda: flush(run, slots),
                )

            cache, slots, run = all_slots(cache, run)
            live, _ = status(slots, run, length)
            return jax.lax.cond(
                live > 0, lambda: rung(1, cache, slots, run), lambda: flush(run, slots)
            )

        zeros_s = jnp.zeros((num_slots,), jnp.int32)
        run = _Run(
            slots=_Slots(
                *(zeros_s,) * 3,
                *(jnp.zeros((num_slots,), bool),) * 2,
                jnp.full((num_slots, length), pad, jnp.int32),
                jnp.zeros((num_slots, length), jnp.float32),
            ),
            tokens_nl=jnp.full((n, length), pad, jnp.int32),
            logprobs_nl=jnp.zeros((n, length), jnp.float32),
            lengths_n=jnp.zeros((n,), jnp.int32),
            ended_n=jnp.zeros((n,), bool),
            waiting=jnp.asarray(num_slots, jnp.int32),
            steps=jnp.zeros((), jnp.int32),
            rows=jnp.zeros((), jnp.int32),
            done_g=jnp.zeros((num_prompts,), jnp.int32),
        )
        cache = self.empty_cache(num_slots, prompt_len + caps_p[0])
        slot_s = jnp.arange(num_slots, dtype=jnp.int32)
        first_s = jnp.asarray(first_rollouts(num_slots, shards), jnp.int32)
        cache, run = start(cache, run, slot_s, first_s, jnp.ones((num_slots,), bool), True)
        if n > num_slots:  # rollouts that ended at their first token free their slots at once
            cache, run = refill(cache, run)
        final = decode(cache, run)
        return SampleOutput(
            tokens_bt=final.tokens_nl,
            logprobs_bt=final.logprobs_nl,
            lengths_b=final.lengths_n,
            truncated_b=~final.ended_n,
            num_decode_steps=final.steps,
            rows_decoded=final.rows,
            # a rollout of length l is decoded while running in l - 1 iterations
            live_rows_decoded=jnp.sum(jnp.maximum(final.lengths_n - 1, 0)),
            prefill_rows=jnp.asarray(num_prompts, jnp.int32),
            cut_b=~(final.ended_n | (final.lengths_n >= length)),
        )


_SAMPLERS: dict = {}


def sample(
    model: Decoder,
    prompt_ids_bt,
    prompt_lens_b,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] | None = None,
    pad_id: int = 0,
) -> SampleOutput:
    """One-call convenience over `Sampler`, reusing one Sampler per (graphdef, eos, pad)."""
    graphdef, state = nnx.split(model)
    eos = tuple(model.config.eos_ids if eos_ids is None else eos_ids)
    sampler_key = (graphdef, eos, pad_id)
    if sampler_key not in _SAMPLERS:
        _SAMPLERS[sampler_key] = Sampler(graphdef, model.config, eos_ids=eos, pad_id=pad_id)
    return _SAMPLERS[sampler_key](
        state,
        prompt_ids_bt,
        prompt_lens_b,
        key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
