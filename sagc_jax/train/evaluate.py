"""Held-out evaluation: greedy decoding of a fixed set of held-out prompts."""

from __future__ import annotations

import jax
import numpy as np

from sagc_jax.config import Config
from sagc_jax.sampling.sampler import Sampler
from sagc_jax.train.rollout import generate


def policy_sampler(graphdef, model_config, tokenizer, keep_cache: bool = True) -> Sampler:
    """A sampler of the policy that stops at the tokenizer's end token and pads with its pad."""
    return Sampler(
        graphdef,
        model_config,
        eos_ids=(tokenizer.eos_id,),
        pad_id=tokenizer.pad_id,
        keep_cache=keep_cache,
    )


def evaluate_policy(sampler, params, source, cfg: Config, num: int | None = None) -> dict:
    """Greedy held-out accuracy (reward >= 1), mean reward and mean completion length."""
    prompts = source.heldout(num or cfg.train.eval_size)
    r = generate(
        sampler,
        params,
        source,
        prompts,
        1,
        jax.random.key(0),
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        buckets=cfg.sampling.prompt_buckets,
        reward_on_error="zero",
    )
    return {
        "eval/accuracy": float(np.mean(r.rewards >= 1.0)),
        "eval/reward": float(r.rewards.mean()),
        "eval/length_mean": float(r.lengths.mean()),
        "eval/truncated_frac": float(r.truncated.mean()),
    }
