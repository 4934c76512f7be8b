"""Held-out evaluation: greedy decoding of a fixed set of held-out prompts, or several sampled
completions of each."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from sagc_jax.config import Config
from sagc_jax.parallel import gather_rows
from sagc_jax.sampling.padding import bucket_length
from sagc_jax.tasks.prompt_source import Prompt
from sagc_jax.train.rollout import generate


@dataclass(frozen=True)
class HeldoutCompletions:
    """Every completion of a held-out evaluation, prompt-major: ``[prompts, samples]`` arrays of
    its reward (float), its length in tokens (EOS included) and whether it was cut at
    ``max_new_tokens`` (no EOS); the prompts, and the completions' texts (``[prompts][samples]``;
    None when several processes decoded, each its share)."""

    rewards_pk: np.ndarray
    lengths_pk: np.ndarray
    truncated_pk: np.ndarray
    max_new_tokens: int
    prompts: tuple[Prompt, ...] = ()
    texts_pk: tuple[tuple[str, ...], ...] | None = None


def heldout_prompts(sampler, source, num: int) -> list[Prompt]:
    """The first ``num`` held-out prompts, the last repeated up to a multiple of the sampler's
    batch shards (every shard decodes as many)."""
    prompts = source.heldout(num)
    shards = sampler.plan.batch_shards if sampler.plan is not None else 1
    return prompts + prompts[-1:] * (-len(prompts) % shards)


def heldout_shape(sampler, source, cfg: Config, num: int | None = None) -> tuple[int, int]:
    """(rollouts over every process, prompt bucket) of the greedy evaluation's one sampler
    call (``heldout_completions``), to compile it ahead."""
    prompts = heldout_prompts(sampler, source, num or cfg.train.eval_size)
    longest = max(len(source.encode(p)) for p in prompts)
    return len(prompts), bucket_length(longest, source.prompt_buckets)


def heldout_completions(
    sampler, params, source, cfg: Config, num: int | None = None, samples: int = 1
) -> HeldoutCompletions:
    """``samples`` completions of each of ``num`` held-out prompts (default
    ``train.eval_size``): greedy when ``samples`` = 1, else drawn at the config's temperature,
    top-p and top-k.

    On a mesh the prompts are padded (repeating the last) to a multiple of the batch shards and
    every process decodes its share; the arrays cover the real prompts only, on every process.
    """
    count = len(source.heldout(num or cfg.train.eval_size))
    prompts = heldout_prompts(sampler, source, num or cfg.train.eval_size)
    share = len(prompts) // jax.process_count()
    first = jax.process_index() * share
    s = cfg.sampling
    greedy = samples == 1
    r = generate(
        sampler,
        params,
        source,
        prompts[first : first + share],
        samples,
        jax.random.key(0),
        max_new_tokens=s.max_new_tokens,
        temperature=0.0 if greedy else s.temperature,
        top_p=1.0 if greedy else s.top_p,
        top_k=0 if greedy else s.top_k,
        buckets=source.prompt_buckets,  # sampling.prompt_buckets, 'auto' resolved
        reward_on_error="zero",
    )
    rows = count * samples  # the real prompts' rows come first, in prompt order
    texts_pk = None
    if jax.process_count() == 1:  # text is not gathered: one process holds every row
        texts_pk = tuple(tuple(r.texts[p * samples : (p + 1) * samples]) for p in range(count))
    return HeldoutCompletions(
        rewards_pk=gather_rows(r.rewards)[:rows].reshape(count, samples),
        lengths_pk=gather_rows(r.lengths)[:rows].reshape(count, samples),
        truncated_pk=gather_rows(r.truncated)[:rows].reshape(count, samples).astype(bool),
        max_new_tokens=s.max_new_tokens,
        prompts=tuple(prompts[:count]),
        texts_pk=texts_pk,
    )


def eval_metrics(c: HeldoutCompletions) -> dict:
    """Held-out accuracy (reward >= 1), mean reward and completion length, and the share
    truncated, means over every completion; with several samples per prompt also
    ``eval/pass@k`` (the unbiased estimator of Chen et al. 2021: the chance that some of k
    completions of a prompt is right) for k = 1, 2, 4, ... up to the samples."""
    count, samples = c.rewards_pk.shape
    metrics = {
        "eval/accuracy": float(np.mean(c.rewards_pk >= 1.0)),
        "eval/reward": float(c.rewards_pk.mean()),
        "eval/length_mean": float(c.lengths_pk.mean()),
        "eval/truncated_frac": float(c.truncated_pk.mean()),
        "eval/prompts": count,
    }
    if samples > 1:
        right_p = (c.rewards_pk >= 1.0).sum(axis=1)
        ks = sorted({*(2**i for i in range(samples.bit_length()) if 2**i <= samples), samples})
        metrics.update({f"eval/pass@{k}": pass_at_k(right_p, samples, k) for k in ks})
    return metrics


def evaluate_policy(
    sampler, params, source, cfg: Config, num: int | None = None, samples: int = 1
) -> dict:
    """`eval_metrics` of `heldout_completions`: greedy (``samples`` = 1, what a run logs) or
    ``samples`` sampled completions per prompt."""
    return eval_metrics(heldout_completions(sampler, params, source, cfg, num, samples))


def pass_at_k(right_p: np.ndarray, n: int, k: int) -> float:
    """Mean over prompts of ``1 - C(n - c, k) / C(n, k)``: the chance that k completions drawn
    without replacement from a prompt's ``n`` (``c`` = ``right_p`` of them right) hold a right
    one; computed as a product, stable for any n."""
    chances = [
        1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
        for c in np.asarray(right_p, int)
    ]
    return float(np.mean(chances))
