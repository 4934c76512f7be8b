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

The decode loop is ``decode``'s functions over an explicit state (the cache and a
`decode.Run`); `Sampler` checks the arguments, builds the call's static `decode.Context`, jits.
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

from sagc_jax.config import SamplingConfig
from sagc_jax.decode_schedule import phase_slots, resolve_chunk, row_rungs
from sagc_jax.models import DecoderConfig, KVCache
from sagc_jax.parallel import ShardingPlan
from sagc_jax.sampling import decode


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
        return decode.empty_cache(self.config, self.plan, batch, slots)

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
        num_prompts, prompt_len = prompt_ids_pt.shape
        ctx = decode.Context(
            graphdef=self.graphdef,
            config=self.config,
            plan=self.plan,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            rollouts=prompt_index_r.shape[0],
            prompts=num_prompts,
            prompt_len=prompt_len,
            length=max_new_tokens,
            slots=num_slots,
            caps=phase_slots(max_new_tokens, resolve_chunk(max_new_tokens, self.decode_chunk)),
            rungs=row_rungs(num_slots, self.row_buckets, self.shards),
            keep_groups=keep_groups,
        )
        inputs = decode.prefill(
            ctx, state, prompt_ids_pt, start_p, prompt_index_r, key, temperature, top_p, top_k
        )
        final = decode.decode(ctx, inputs, *decode.first_start(ctx, inputs))
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
            cut_b=~(final.ended_n | (final.lengths_n >= max_new_tokens)),
        )


def policy_sampler(
    graphdef,
    model_config,
    tokenizer,
    plan=None,
    state_shardings=None,
    sampling: SamplingConfig | None = None,
    slots: int = 0,
) -> Sampler:
    """The sampler of a run's policy, the one way the trainer, ``eval``, ``sft`` and ``plan
    --compile`` build it: stops at the tokenizer's end token and pads with its pad (``None``:
    the architecture's end tokens and pad 0, for compiling without tokenizer files; the pad is
    a value in the program, not a shape), on the mesh of ``plan`` when given, decoding as
    ``sampling`` says (``decode_chunk``, ``row_buckets``; default: `SamplingConfig`'s) through
    ``slots`` rows (0: every rollout of a call; ``sampling.slots`` resolved)."""
    sampling = sampling or SamplingConfig()
    eos_ids = model_config.eos_ids if tokenizer is None else (tokenizer.eos_id,)
    return Sampler(
        graphdef,
        model_config,
        eos_ids=eos_ids,
        pad_id=0 if tokenizer is None else tokenizer.pad_id,
        decode_chunk=sampling.decode_chunk,
        slots=slots,
        row_buckets=sampling.row_buckets,
        plan=plan,
        state_shardings=state_shardings,
    )
