"""Held-out evaluation: greedy decoding of a fixed set of held-out prompts."""

from __future__ import annotations

import jax
import numpy as np

from sagc_jax.config import Config, SamplingConfig
from sagc_jax.parallel import gather_rows
from sagc_jax.sampling.sampler import Sampler
from sagc_jax.train.rollout import generate


def policy_sampler(
    graphdef,
    model_config,
    tokenizer,
    plan=None,
    state_shardings=None,
    sampling: SamplingConfig | None = None,
    slots: int = 0,
) -> Sampler:
    """A sampler of the policy that stops at the tokenizer's end token and pads with its pad
    (on the mesh of ``plan`` when given), decoding as ``sampling`` says (``decode_chunk``,
    ``row_buckets``; default: `SamplingConfig`'s) through ``slots`` rows (0: every rollout of a
    call; ``sampling.slots`` resolved, see `Sampler`)."""
    sampling = sampling or SamplingConfig()
    return Sampler(
        graphdef,
        model_config,
        eos_ids=(tokenizer.eos_id,),
        pad_id=tokenizer.pad_id,
        decode_chunk=sampling.decode_chunk,
        slots=slots,
        row_buckets=sampling.row_buckets,
        plan=plan,
        state_shardings=state_shardings,
    )


def evaluate_policy(sampler, params, source, cfg: Config, num: int | None = None) -> dict:
    """Greedy held-out accuracy (reward >= 1), mean reward and mean completion length.

    On a mesh the prompts are padded (repeating the last) to a multiple of the batch shards and
    every process decodes its share; the figures cover the real prompts only.
    """
    prompts = source.heldout(num or cfg.train.eval_size)
    count = len(prompts)
    shards = sampler.plan.batch_shards if sampler.plan is not None else 1
    prompts = prompts + prompts[-1:] * (-count % shards)
    share = len(prompts) // jax.process_count()
    first = jax.process_index() * share
    r = generate(
        sampler,
        params,
        source,
        prompts[first : first + share],
        1,
        jax.random.key(0),
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        buckets=source.prompt_buckets,  # sampling.prompt_buckets, 'auto' resolved
        reward_on_error="zero",
    )
    rewards = gather_rows(r.rewards)[:count]
    lengths = gather_rows(r.lengths)[:count]
    return {
        "eval/accuracy": float(np.mean(rewards >= 1.0)),
        "eval/reward": float(rewards.mean()),
        "eval/length_mean": float(lengths.mean()),
        "eval/truncated_frac": float(gather_rows(r.truncated)[:count].mean()),
    }
