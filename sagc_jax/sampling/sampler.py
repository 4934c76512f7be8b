"""Batched generation: one prefill over left-padded prompts, then a `lax.while_loop` of single-token
decode steps over a KV cache that stops as soon as every row has produced an end-of-sequence token.

Compiled once per (batch, prompt bucket, max_new_tokens): the model is split into graphdef
(static) and state (arrays), and temperature / top_p / top_k / the key are array arguments, so
new prompts, seeds or sampling settings reuse the program. The cache buffer is donated and, by
default, kept for the next call of the same shape.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sagc_jax.models import Decoder, DecoderConfig, KVCache, init_cache
from sagc_jax.parallel import ShardingPlan
from sagc_jax.sampling.functions import sample_token


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


class _Loop(NamedTuple):
    step: jax.Array  # index of the completion token the next iteration writes
    cache: KVCache
    last_b: jax.Array
    tokens_bt: jax.Array
    logprobs_bt: jax.Array
    done_b: jax.Array
    lengths_b: jax.Array


class Sampler:
    """Generates completions from a `Decoder` split as (graphdef, state).

    eos_ids: tokens that end a row (default: config.eos_ids); empty means never stop early.
    pad_id: the token written after a row's end (and expected in prompt padding).
    keep_cache: keep the donated cache buffer for the next call of the same shape.
    batch_sharding: optional `NamedSharding(mesh, P(axis))` splitting the rows across the
        devices of `axis` (data parallel; `state` replicated). Each device then runs its own
        decode loop and stops when its own rows are done; `num_decode_steps` is the maximum.
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
        keep_cache: bool = True,
        batch_sharding: jax.sharding.NamedSharding | None = None,
        plan: ShardingPlan | None = None,
        state_shardings=None,
    ):
        if plan is not None and (batch_sharding is not None or state_shardings is None):
            raise ValueError("Sampler: plan needs state_shardings and excludes batch_sharding")
        self.graphdef = graphdef
        self.config = config
        self.eos_ids = tuple(config.eos_ids if eos_ids is None else eos_ids)
        self.pad_id = int(pad_id)
        self.keep_cache = keep_cache
        self.batch_sharding = batch_sharding
        self.plan = plan
        self.num_traces = 0  # incremented each time the generation program is traced
        self._cache: KVCache | None = None
        impl = self._generate_impl if batch_sharding is None else self._generate_per_shard
        jit_kw = {}
        self._empty_cache = functools.partial(init_cache, config)
        self._decode_shardings = None
        if plan is not None and plan.mesh.shape["fsdp"] > 1:
            self._decode_shardings = plan.for_decoding(state_shardings)
        if plan is not None:
            cache = plan.cache(jax.eval_shape(lambda: init_cache(config, plan.batch_shards, 1)))
            rows, scalar = plan.rows, plan.replicated
            jit_kw = dict(
                in_shardings=(state_shardings, rows, cache, scalar, scalar, scalar, scalar),
                out_shardings=(SampleOutput(rows, rows, rows, rows, scalar), cache),
            )
            # Allocated in place, already split: no full-size cache on one device first.
            self._empty_cache = jax.jit(
                self._empty_cache, static_argnums=(0, 1), out_shardings=cache
            )
        # max_new_tokens (last, static) is positional: jit takes no keywords with shardings.
        self._generate = jax.jit(impl, static_argnums=(7,), donate_argnums=(2,), **jit_kw)

    @classmethod
    def from_model(cls, model: Decoder, **kwargs) -> tuple[Sampler, nnx.State]:
        """(sampler, state) for `model`: call `sampler(state, ...)`."""
        graphdef, state = nnx.split(model)
        return cls(graphdef, model.config, **kwargs), state

    def compiled_programs(self) -> int:
        """Programs this sampler has traced and compiled (one per batch/bucket/max_new_tokens
        shape). Counted per instance: the jit cache of a method is shared by all instances."""
        return self.num_traces

    def release_cache(self) -> None:
        self._cache = None

    def compile(self, state: nnx.State, batch: int, prompt_len: int, *, max_new_tokens: int):
        """Compiles the program for (batch, prompt_len, max_new_tokens) ahead of time, without
        running it; the next call of that shape reuses the executable (no recompile)."""

        # Shapes with the shardings a real call has (they are part of the cache key).
        def spec(x, sharding=None):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        cache = jax.eval_shape(lambda: init_cache(self.config, batch, prompt_len + max_new_tokens))
        prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
        if self.plan is not None:
            # (scalars are passed uncommitted, as in a real call)
            cache = jax.tree.map(spec, cache, self.plan.cache(cache)._replace(index=None))
            prompts = spec(prompts, self.plan.rows)
        self._generate.lower(
            jax.tree.map(lambda x: spec(x, getattr(x, "sharding", None)), state),
            prompts,
            cache,
            jax.random.key(0),
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
        if self.plan is None:
            prompt_ids_bt = jnp.asarray(prompt_ids_bt, jnp.int32)
        local_batch, prompt_len = prompt_ids_bt.shape
        lens_b = np.asarray(prompt_lens_b, np.int32)
        if lens_b.shape != (local_batch,) or lens_b.min() < 1 or lens_b.max() > prompt_len:
            raise ValueError(
                f"prompt_lens_b {lens_b.tolist()} must have shape ({local_batch},) and values in "
                f"[1, {prompt_len}] for prompt_ids_bt of shape {tuple(prompt_ids_bt.shape)}"
            )
        start_b = np.asarray(prompt_len - lens_b, np.int32)
        if self.plan is not None:  # this process's rows -> global arrays
            prompt_ids_bt, start_b = self.plan.global_rows(
                (np.asarray(prompt_ids_bt, np.int32), start_b)
            )
        shape = (prompt_ids_bt.shape[0], prompt_len + max_new_tokens)
        cache = self._cache
        if cache is None or (len(cache.start_b), cache.v_lbksh[0].shape[2]) != shape:
            cache = self._empty_cache(*shape)
        self._cache = None
        # Stale keys/values from an earlier call are never read: slots before start_b and from
        # index on are masked, and prefill rewrites every slot in between.
        cache = cache._replace(start_b=jnp.asarray(start_b), index=jnp.zeros((), jnp.int32))
        if self.batch_sharding is not None:
            prompt_ids_bt, cache = self._place(prompt_ids_bt, cache)
        out, cache = self._generate(
            state,
            prompt_ids_bt,
            cache,
            key,
            jnp.asarray(temperature, jnp.float32),
            jnp.asarray(top_p, jnp.float32),
            jnp.asarray(top_k, jnp.int32),
            max_new_tokens,
        )
        if self.keep_cache:
            self._cache = cache
        return out

    def to_host(self, out: SampleOutput) -> SampleOutput:
        """``out`` as numpy, only this process's rows when the sampler has a plan."""
        if self.plan is not None:
            return self.plan.local_rows(out)
        return jax.device_get(out)

    def _place(self, prompt_ids_bt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Puts batch-leading arrays on `batch_sharding`, the cache index replicated."""
        replicated = jax.sharding.NamedSharding(
            self.batch_sharding.mesh, jax.sharding.PartitionSpec()
        )
        shardings = KVCache(
            k_lbkhs=tuple(self.batch_sharding for _ in cache.k_lbkhs),
            v_lbksh=tuple(self.batch_sharding for _ in cache.v_lbksh),
            start_b=self.batch_sharding,
            index=replicated,
        )
        return jax.device_put(prompt_ids_bt, self.batch_sharding), jax.device_put(cache, shardings)

    def _generate_per_shard(
        self, state, prompt_ids_bt, cache, key, temperature, top_p, top_k, max_new_tokens
    ):
        """`_generate_impl` on each device's rows (shard_map): every device leaves its decode loop
        when its own rows are done, with no cross-device sync per step. Each shard draws from
        fold_in(key, shard index)."""
        axis = self.batch_sharding.spec[0]
        rows, replicated = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
        cache_spec = KVCache(
            k_lbkhs=tuple(rows for _ in cache.k_lbkhs),
            v_lbksh=tuple(rows for _ in cache.v_lbksh),
            start_b=rows,
            index=replicated,
        )

        def local(state, prompt_ids_bt, cache, key, temperature, top_p, top_k):
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
            args = (state, prompt_ids_bt, cache, key, temperature, top_p, top_k)
            out, cache = self._generate_impl(*args, max_new_tokens)
            return out._replace(num_decode_steps=out.num_decode_steps[None]), cache

        out, cache = jax.shard_map(
            local,
            mesh=self.batch_sharding.mesh,
            in_specs=(replicated, rows, cache_spec, replicated, replicated, replicated, replicated),
            out_specs=(SampleOutput(rows, rows, rows, rows, rows), cache_spec),
            check_vma=False,
        )(state, prompt_ids_bt, cache, key, temperature, top_p, top_k)
        return out._replace(num_decode_steps=jnp.max(out.num_decode_steps)), cache

    def _generate_impl(self, *args):
        self.num_traces += 1  # Python side effect: runs once per trace, never per call
        with self.plan.activate() if self.plan is not None else contextlib.nullcontext():
            return self._generate_traced(*args)

    def _generate_traced(
        self, state, prompt_ids_bt, cache, key, temperature, top_p, top_k, max_new_tokens
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
        batch = prompt_ids_bt.shape[0]
        eos_e = jnp.asarray(self.eos_ids, jnp.int32).reshape(-1)

        def is_eos(token_b):
            return jnp.any(token_b[:, None] == eos_e[None, :], axis=-1)

        def draw(logits_b1v, step):
            return sample_token(
                logits_b1v[:, 0], jax.random.fold_in(key, step), temperature, top_p, top_k
            )

        logits_b1v, cache = model.apply_cached(prompt_ids_bt, cache, last_only=True)
        token_b, logprob_b = draw(logits_b1v, 0)
        tokens_bt = jnp.full((batch, max_new_tokens), self.pad_id, jnp.int32)
        logprobs_bt = jnp.zeros((batch, max_new_tokens), jnp.float32)
        init = _Loop(
            step=jnp.ones((), jnp.int32),
            cache=cache,
            last_b=token_b,
            tokens_bt=tokens_bt.at[:, 0].set(token_b),
            logprobs_bt=logprobs_bt.at[:, 0].set(logprob_b),
            done_b=is_eos(token_b),
            lengths_b=jnp.ones((batch,), jnp.int32),
        )

        def cond(s: _Loop):
            return (s.step < max_new_tokens) & ~jnp.all(s.done_b)

        def body(s: _Loop) -> _Loop:
            logits_b1v, cache = model.apply_cached(s.last_b[:, None], s.cache)
            token_b, logprob_b = draw(logits_b1v, s.step)
            token_b = jnp.where(s.done_b, self.pad_id, token_b)
            logprob_b = jnp.where(s.done_b, 0.0, logprob_b)
            return _Loop(
                step=s.step + 1,
                cache=cache,
                last_b=token_b,
                tokens_bt=jax.lax.dynamic_update_slice(s.tokens_bt, token_b[:, None], (0, s.step)),
                logprobs_bt=jax.lax.dynamic_update_slice(
                    s.logprobs_bt, logprob_b[:, None], (0, s.step)
                ),
                done_b=s.done_b | is_eos(token_b),
                lengths_b=s.lengths_b + (~s.done_b).astype(jnp.int32),
            )

        final = jax.lax.while_loop(cond, body, init)
        out = SampleOutput(
            tokens_bt=final.tokens_bt,
            logprobs_bt=final.logprobs_bt,
            lengths_b=final.lengths_b,
            truncated_b=~final.done_b,
            num_decode_steps=final.step - 1,
        )
        return out, final.cache


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
