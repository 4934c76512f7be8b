"""Batched generation: one prefill over left-padded prompts, then single-token decode steps over a
KV cache that stop as soon as every row has produced an end-of-sequence token.

The decode loop runs in phases whose cache grows by `decode_chunk` slots (`phase_slots`): phase p
is a `lax.while_loop` over a cache of prompt + min(chunk * (p + 1), max_new_tokens) slots, so a
step at completion position t attends over about t slots, not the whole cache. Between phases the
cache is padded with zeros to the next phase's size; once every row is done the remaining phases
are skipped. The phases are unrolled in one trace, so there is one compiled program per (batch,
prompt bucket, max_new_tokens); the cache lives inside that program only.

The model is split into graphdef (static) and state (arrays), and temperature / top_p / top_k /
the key are array arguments, so new prompts, seeds or sampling settings reuse the program.
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
from sagc_jax.parallel import ShardingPlan
from sagc_jax.sampling.functions import sample_token

AUTO_CHUNK_MIN = 32  # 'auto': at least this many slots per phase...
AUTO_PHASES = 8  # ...and at most this many phases (each is one more loop body to compile)


class SampleOutput(NamedTuple):
    """What `Sampler.__call__` returns (B rows, L = max_new_tokens).

    tokens_bt: int32 [B, L] completion tokens, pad_id after each row's end.
    logprobs_bt: float32 [B, L] log-probability of each token under the policy (see
        `sample_token`), 0 after each row's end.
    lengths_b: int32 [B] completion lengths, the end-of-sequence token included.
    truncated_b: bool [B] True where no end-of-sequence token came within L tokens.
    num_decode_steps: int32 [] decode iterations run (at most L - 1; fewer on early exit).
    """

    tokens_bt: jax.Array
    logprobs_bt: jax.Array
    lengths_b: jax.Array
    truncated_b: jax.Array
    num_decode_steps: jax.Array


def _setting(value, dtype):
    """A sampling setting as the program takes it: a jax array as it is (cast if needed), a
    number as a numpy scalar, which the call transfers with its arguments (``jnp.asarray`` of a
    Python number runs a conversion program of its own: three per call)."""
    if isinstance(value, jax.Array):
        return jnp.asarray(value, dtype)
    return np.asarray(value, dtype)


class _Loop(NamedTuple):
    """Decode-loop state carried across phases (the cache, whose size changes, travels apart)."""

    step: jax.Array  # index of the completion token the next iteration writes
    last_b: jax.Array
    tokens_bt: jax.Array
    logprobs_bt: jax.Array
    done_b: jax.Array
    lengths_b: jax.Array


def resolve_chunk(max_new_tokens: int, decode_chunk: int | str = "auto") -> int:
    """Cache slots added per decode phase; 0 means one phase over the whole cache.

    'auto' is max(AUTO_CHUNK_MIN, ceil(max_new_tokens / AUTO_PHASES)): short completions keep one
    phase, long ones at most AUTO_PHASES (compile time grows with the number of phases).
    """
    if decode_chunk == "auto":
        return max(AUTO_CHUNK_MIN, -(-max_new_tokens // AUTO_PHASES))
    if isinstance(decode_chunk, bool) or not isinstance(decode_chunk, int) or decode_chunk < 0:
        raise ValueError(f"decode_chunk={decode_chunk!r}; use an int >= 0 (0: one phase) or 'auto'")
    return decode_chunk


def phase_slots(max_new_tokens: int, chunk: int) -> tuple[int, ...]:
    """Completion slots of the cache in each decode phase (the cache holds prompt + these).

    Decode step s (1 <= s < max_new_tokens) writes token s - 1 at completion slot s - 1 and
    samples token s, so a phase of n slots runs the steps up to n. chunk 0 (or one that covers
    every step) gives a single phase of max_new_tokens slots: the whole cache in every step.
    """
    steps = max_new_tokens - 1
    if chunk <= 0 or chunk >= steps:
        return (max_new_tokens,)
    return tuple(min(chunk * (p + 1), max_new_tokens) for p in range(-(-steps // chunk)))


class Sampler:
    """Generates completions from a `Decoder` split as (graphdef, state).

    eos_ids: tokens that end a row (default: config.eos_ids); empty means never stop early.
    pad_id: the token written after a row's end (and expected in prompt padding).
    decode_chunk: cache slots added per decode phase (see the module docstring and
        `resolve_chunk`); 0 attends over the whole cache in every step. Tokens do not depend
        on it: the key of step s is fold_in(key, s) in every phase.
    plan, state_shardings: a `ShardingPlan` and the shardings of `state` (FSDP / tensor / data
        parallel, several processes): the program is jitted with those input and output
        shardings, rows split over the plan's batch axes, the KV cache over rows and KV heads.
        Calls then take each process's own rows (numpy) and return global arrays; `to_host`
        gives each process its rows back.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: DecoderConfig,
        *,
        eos_ids: Sequence[int] | None = None,
        pad_id: int = 0,
        decode_chunk: int | str = "auto",
        plan: ShardingPlan | None = None,
        state_shardings=None,
    ):
        if plan is not None and state_shardings is None:
            raise ValueError("Sampler: plan needs state_shardings (e.g. plan.params(state))")
        resolve_chunk(1, decode_chunk)  # raises early on a bad value
        self.graphdef = graphdef
        self.config = config
        self.eos_ids = tuple(config.eos_ids if eos_ids is None else eos_ids)
        self.pad_id = int(pad_id)
        self.decode_chunk = decode_chunk
        self.plan = plan
        self.num_traces = 0  # incremented each time the generation program is traced
        jit_kw = {}
        self._decode_shardings = None
        if plan is not None and plan.mesh.shape["fsdp"] > 1:
            self._decode_shardings = plan.for_decoding(state_shardings)
        if plan is not None:
            rows, scalar = plan.rows, plan.replicated
            jit_kw = dict(
                in_shardings=(state_shardings, rows, rows, scalar, scalar, scalar, scalar),
                out_shardings=SampleOutput(rows, rows, rows, rows, scalar),
            )
        # max_new_tokens (last, static) is positional: jit takes no keywords with shardings.
        self._generate = jax.jit(self._generate_impl, static_argnums=(7,), **jit_kw)

    @classmethod
    def from_model(cls, model: Decoder, **kwargs) -> tuple[Sampler, nnx.State]:
        """(sampler, state) for `model`: call `sampler(state, ...)`."""
        graphdef, state = nnx.split(model)
        return cls(graphdef, model.config, **kwargs), state

    def compiled_programs(self) -> int:
        """Programs this sampler has traced and compiled (one per batch/bucket/max_new_tokens
        shape). Counted per instance: the jit cache of a method is shared by all instances."""
        return self.num_traces

    def empty_cache(self, batch: int, slots: int) -> KVCache:
        """A zero cache of `slots` slots for `batch` rows, split as the plan says (rows and KV
        heads), as the program allocates it for its first phase."""
        return self._constrain(init_cache(self.config, batch, slots))

    def compile(
        self, state: nnx.State, batch: int, prompt_len: int, *, max_new_tokens: int
    ) -> jax.stages.Compiled:
        """Compiles the program for (batch, prompt_len, max_new_tokens) ahead of time, without
        running it; the next call of that shape reuses the executable (no recompile). Returns
        it (``.as_text()``: its optimised HLO)."""

        # Shapes with the shardings a real call has (they are part of the cache key): an
        # uncommitted array (one device, no plan) has none, or the call compiles once more.
        def spec(x):
            committed = self.plan is not None or getattr(x, "committed", False)
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=x.sharding if committed else None
            )

        rows = self.plan.rows if self.plan is not None else None
        return self._generate.lower(
            jax.tree.map(spec, state),
            jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),
            jax.random.key(0),  # (scalars are passed uncommitted, as in a real call)
            jnp.float32(1.0),
            jnp.float32(1.0),
            jnp.int32(0),
            max_new_tokens,
        ).compile()

    def __call__(
        self,
        state: nnx.State,
        prompt_ids_bt,
        prompt_lens_b,
        key: jax.Array,
        *,
        max_new_tokens: int,
        temperature: float | jax.Array = 1.0,
        top_p: float | jax.Array = 1.0,
        top_k: int | jax.Array = 0,
    ) -> SampleOutput:
        """Samples up to `max_new_tokens` tokens after each left-padded prompt.

        prompt_ids_bt: int32 [B, P], row b's prompt in its last prompt_lens_b[b] columns
            (`left_pad` builds it with P a bucket); prompt_lens_b: int32 [B], each >= 1.
        temperature <= 0 is greedy; top_k <= 0 and top_p >= 1 disable those filters.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}; must be >= 1")
        # [B, P] token ids: a float array would be cast to ids without an error
        chex.assert_rank(prompt_ids_bt, 2)
        chex.assert_type(prompt_ids_bt, int)
        local_batch, prompt_len = np.shape(prompt_ids_bt)
        lens_b = np.asarray(prompt_lens_b, np.int32)
        if lens_b.shape != (local_batch,) or lens_b.min() < 1 or lens_b.max() > prompt_len:
            raise ValueError(
                f"prompt_lens_b {lens_b.tolist()} must have shape ({local_batch},) and values in "
                f"[1, {prompt_len}] for prompt_ids_bt of shape {np.shape(prompt_ids_bt)}"
            )
        start_b = np.asarray(prompt_len - lens_b, np.int32)  # first cache slot of each row
        if self.plan is not None:  # this process's rows -> global arrays
            prompt_ids_bt, start_b = self.plan.global_rows(
                (np.asarray(prompt_ids_bt, np.int32), start_b)
            )
        else:
            # with a dtype: a plain transfer (without one, jnp.asarray runs a program)
            prompt_ids_bt = jnp.asarray(prompt_ids_bt, jnp.int32)
            start_b = jnp.asarray(start_b, jnp.int32)
        return self._generate(
            state,
            prompt_ids_bt,
            start_b,
            key,
            _setting(temperature, np.float32),
            _setting(top_p, np.float32),
            _setting(top_k, np.int32),
            max_new_tokens,
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
        """`cache` padded with zero slots at the end up to `slots` (what the next phase uses;
        slots from `index` on are masked, so their content is never read)."""
        extra = slots - cache.v_lbksh[0].shape[2]
        return self._constrain(
            cache._replace(
                k_lbkhs=tuple(jnp.pad(k, ((0, 0),) * 3 + ((0, extra),)) for k in cache.k_lbkhs),
                v_lbksh=tuple(
                    jnp.pad(v, ((0, 0),) * 2 + ((0, extra), (0, 0))) for v in cache.v_lbksh
                ),
            )
        )

    def _generate_impl(self, *args):
        self.num_traces += 1  # Python side effect: runs once per trace, never per call
        with self.plan.activate() if self.plan is not None else contextlib.nullcontext():
            return self._generate_traced(*args)

    def _generate_traced(
        self, state, prompt_ids_bt, start_b, key, temperature, top_p, top_k, max_new_tokens
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
        batch, prompt_len = prompt_ids_bt.shape
        slots_p = phase_slots(max_new_tokens, resolve_chunk(max_new_tokens, self.decode_chunk))
        eos_e = jnp.asarray(self.eos_ids, jnp.int32).reshape(-1)

        def is_eos(token_b):
            return jnp.any(token_b[:, None] == eos_e[None, :], axis=-1)

        def draw(logits_b1v, step):
            # The key depends on the step only (not the phase): tokens do not depend on chunk.
            return sample_token(
                logits_b1v[:, 0], jax.random.fold_in(key, step), temperature, top_p, top_k
            )

        cache = self.empty_cache(batch, prompt_len + slots_p[0])._replace(start_b=start_b)
        logits_b1v, cache = model.apply_cached(prompt_ids_bt, cache, last_only=True)
        token_b, logprob_b = draw(logits_b1v, 0)
        tokens_bt = jnp.full((batch, max_new_tokens), self.pad_id, jnp.int32)
        logprobs_bt = jnp.zeros((batch, max_new_tokens), jnp.float32)
        init = _Loop(
            step=jnp.ones((), jnp.int32),
            last_b=token_b,
            tokens_bt=tokens_bt.at[:, 0].set(token_b),
            logprobs_bt=logprobs_bt.at[:, 0].set(logprob_b),
            done_b=is_eos(token_b),
            lengths_b=jnp.ones((batch,), jnp.int32),
        )

        def body(carry: tuple[KVCache, _Loop]) -> tuple[KVCache, _Loop]:
            cache, s = carry
            logits_b1v, cache = model.apply_cached(s.last_b[:, None], cache)
            token_b, logprob_b = draw(logits_b1v, s.step)
            token_b = jnp.where(s.done_b, self.pad_id, token_b)
            logprob_b = jnp.where(s.done_b, 0.0, logprob_b)
            return cache, _Loop(
                step=s.step + 1,
                last_b=token_b,
                tokens_bt=jax.lax.dynamic_update_slice(s.tokens_bt, token_b[:, None], (0, s.step)),
                logprobs_bt=jax.lax.dynamic_update_slice(
                    s.logprobs_bt, logprob_b[:, None], (0, s.step)
                ),
                done_b=s.done_b | is_eos(token_b),
                lengths_b=s.lengths_b + (~s.done_b).astype(jnp.int32),
            )

        def decode(phase: int, cache: KVCache, s: _Loop) -> _Loop:
            """Phases phase, phase + 1, ... (Python recursion: unrolled in the trace)."""
            stop = min(slots_p[phase] + 1, max_new_tokens)  # the steps this cache has slots for

            def cond(carry):
                return (carry[1].step < stop) & ~jnp.all(carry[1].done_b)

            cache, s = jax.lax.while_loop(cond, body, (cache, s))
            if phase + 1 == len(slots_p):
                return s
            grown = prompt_len + slots_p[phase + 1]
            return jax.lax.cond(
                jnp.all(s.done_b), lambda: s, lambda: decode(phase + 1, self._grow(cache, grown), s)
            )

        final = decode(0, cache, init)
        return SampleOutput(
            tokens_bt=final.tokens_bt,
            logprobs_bt=final.logprobs_bt,
            lengths_b=final.lengths_b,
            truncated_b=~final.done_b,
            num_decode_steps=final.step - 1,
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
