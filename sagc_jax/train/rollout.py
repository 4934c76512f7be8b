"""Rollouts on the host side: one round (``generate``: prompts -> tokens -> sampler -> text ->
rewards) and a training step's batch of them (``sample_step``: one round, DAPO dynamic
sampling's rounds, or tail batching's round), with the rewards' overlong shaping.

The rollouts are prompt p's G_p completions consecutively (one G for every prompt, or per-prompt
sizes from the hybrid controller); the sampler prefills each prompt once. Its program depends on
(rollouts, prompts, prompt bucket, max_new_tokens), not on the sizes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from sagc_jax.config import Config
from sagc_jax.parallel import any_process, gather_rows
from sagc_jax.programs.shapes import prompts_for
from sagc_jax.rl import informative_groups, overlong_penalty
from sagc_jax.sampling.padding import left_pad
from sagc_jax.tasks import score_batch
from sagc_jax.tasks.prompt_source import Prompt, PromptSource

if TYPE_CHECKING:
    from sagc_jax.programs.tail import TailBatcher


@dataclasses.dataclass
class Rollouts:
    """A round of ``sum_p G_p`` completions (numpy, host memory), group by group."""

    prompts: list[Prompt]  # [P]
    group_sizes: np.ndarray  # int64 [P]: rows of each prompt, consecutive
    prompt_ids: np.ndarray  # int32 [N, bucket], left-padded
    prompt_lens: np.ndarray  # int32 [N]
    completion: np.ndarray  # int32 [N, L]
    logprobs: np.ndarray  # float32 [N, L] at rollout time
    lengths: np.ndarray  # int32 [N], EOS included
    truncated: np.ndarray  # bool [N]
    texts: list[str]  # [N]
    rewards: np.ndarray  # float32 [N], before shaping
    shaped: np.ndarray | None = None  # float32 [N]: after overlong shaping (``sample_step``'s)
    failed_rows: tuple[int, ...] = ()
    timed_out_rows: tuple[int, ...] = ()  # scored 0.0 at the reward's time limit
    batch_timeouts: int = 0  # reward calls of a whole batch past the limit, then scored by row
    decode_steps: int = 0
    rows_decoded: int = 0  # rows of the decode iterations, summed (all processes')
    live_rows_decoded: int = 0  # of those, rows still running
    cut: np.ndarray | None = None  # bool [N]: stopped by tail batching's exit test (None: none)

    @property
    def cut_p(self) -> np.ndarray:
        """bool [P]: groups with a rollout the exit test stopped (their lengths are lower
        bounds)."""
        return np.logical_or.reduceat(self.cut_rows, np.cumsum(self.group_sizes) - self.group_sizes)

    @property
    def group_ids(self) -> np.ndarray:
        """Group (prompt) index of every row, int64 [N]."""
        return np.repeat(np.arange(len(self.group_sizes)), self.group_sizes)

    def select_groups(self, keep_p: np.ndarray) -> Rollouts:
        """The rollouts of the groups whose index is in ``keep_p`` (in that order)."""
        keep_p = np.asarray(keep_p, dtype=np.int64)
        starts_p = np.cumsum(self.group_sizes) - self.group_sizes
        rows = np.concatenate(
            [np.arange(starts_p[p], starts_p[p] + self.group_sizes[p]) for p in keep_p]
            or [np.zeros(0, dtype=np.int64)]
        )
        return dataclasses.replace(
            self,
            prompts=[self.prompts[p] for p in keep_p],
            group_sizes=self.group_sizes[keep_p],
            prompt_ids=self.prompt_ids[rows],
            prompt_lens=self.prompt_lens[rows],
            completion=self.completion[rows],
            logprobs=self.logprobs[rows],
            lengths=self.lengths[rows],
            truncated=self.truncated[rows],
            texts=[self.texts[r] for r in rows],
            rewards=self.rewards[rows],
            shaped=None if self.shaped is None else self.shaped[rows],
            failed_rows=(),
            timed_out_rows=(),
            batch_timeouts=0,
            cut=None if self.cut is None else self.cut[rows],
        )

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        """Rows of several rounds with the same prompt width, in order."""
        if len(parts) == 1:
            return parts[0]
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        return dataclasses.replace(
            parts[0],
            prompts=[q for p in parts for q in p.prompts],
            group_sizes=cat("group_sizes"),
            prompt_ids=cat("prompt_ids"),
            prompt_lens=cat("prompt_lens"),
            completion=cat("completion"),
            logprobs=cat("logprobs"),
            lengths=cat("lengths"),
            truncated=cat("truncated"),
            texts=[t for p in parts for t in p.texts],
            rewards=cat("rewards"),
            shaped=None if any(p.shaped is None for p in parts) else cat("shaped"),
            failed_rows=(),
            timed_out_rows=(),
            batch_timeouts=0,
            decode_steps=sum(p.decode_steps for p in parts),
            rows_decoded=sum(p.rows_decoded for p in parts),
            live_rows_decoded=sum(p.live_rows_decoded for p in parts),
            cut=None if all(p.cut is None for p in parts) else cat("cut_rows"),
        )

    @property
    def cut_rows(self) -> np.ndarray:
        """bool [N]: ``cut``, all False where None."""
        return np.zeros(len(self.lengths), bool) if self.cut is None else self.cut


class StepPrompts:
    """A step's prompts of each round, fetched from the source and encoded once: the
    controller's proposal, the step's prompt width and the rounds' rollouts share them."""

    def __init__(self, source: PromptSource, step: int):
        self.source, self.step = source, step
        self._rounds: dict[tuple[int, int], tuple[list[Prompt], list[list[int]]]] = {}

    def round(self, round_: int, num_prompts: int) -> tuple[list[Prompt], list[list[int]]]:
        """(this process's prompts of round ``round_`` of ``num_prompts`` in all, their token
        ids)."""
        key = (round_, num_prompts)
        if key not in self._rounds:
            prompts = self.source.batch(self.step, round_, num_prompts)
            self._rounds[key] = (prompts, [self.source.encode(p) for p in prompts])
        return self._rounds[key]


def generate(
    sampler,
    params,
    source,
    prompts: list[Prompt],
    group_sizes: int | np.ndarray,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    buckets: tuple[int, ...],
    reward_on_error: str = "raise",
    min_length: int = 0,
    keep_groups: int = 0,
    encoded: list[list[int]] | None = None,
) -> Rollouts:
    """Sample ``group_sizes`` completions of every prompt (one G for all, or int [P] sizes)
    and score them with the source's reward.

    Prompts are padded to the bucket of the longest prompt of every process (the processes'
    rows form one global batch of one width), or of ``min_length`` if longer. ``keep_groups``:
    the sampler's exit test (tail batching; ``Rollouts.cut`` then says which rows it stopped).
    ``encoded``: the prompts' token ids when already encoded.
    """
    encoded = [source.encode(p) for p in prompts] if encoded is None else encoded
    longest = int(gather_rows(np.array([max(min_length, *map(len, encoded))])).max())
    ids_pt, lens_p = left_pad(encoded, source.tokenizer.pad_id, buckets, min_length=longest)
    sizes_p = np.broadcast_to(np.asarray(group_sizes, dtype=np.int64), (len(prompts),)).copy()
    prompt_of_r = np.repeat(np.arange(len(prompts)), sizes_p)
    out = sampler(
        params,
        ids_pt,  # each prompt once: its rollouts share one prefill
        lens_p,
        key,
        prompt_index_r=prompt_of_r,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        keep_groups=keep_groups,
    )
    out = sampler.to_host(out)  # this process's rows
    completion = np.asarray(out.tokens_bt)
    lengths = np.asarray(out.lengths_b)
    eos = source.tokenizer.eos_id
    texts = []
    for row, n in zip(completion, lengths, strict=True):
        ids = row[:n].tolist()
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        texts.append(source.tokenizer.decode(ids))
    texts_prompts = [p.text for p, g in zip(prompts, sizes_p, strict=True) for _ in range(g)]
    answers = [p.answer for p, g in zip(prompts, sizes_p, strict=True) for _ in range(g)]
    scored = score_batch(source.reward_fn, texts_prompts, texts, answers, on_error=reward_on_error)
    return Rollouts(
        prompts=list(prompts),
        group_sizes=sizes_p,
        prompt_ids=ids_pt[prompt_of_r],
        prompt_lens=lens_p[prompt_of_r],
        completion=completion,
        logprobs=np.asarray(out.logprobs_bt),
        lengths=lengths,
        truncated=np.asarray(out.truncated_b),
        texts=texts,
        rewards=scored.rewards,
        failed_rows=scored.failed,
        timed_out_rows=scored.timed_out,
        batch_timeouts=int(scored.batch_timed_out),
        decode_steps=int(out.num_decode_steps),
        rows_decoded=int(out.rows_decoded),
        live_rows_decoded=int(out.live_rows_decoded),
        cut=np.asarray(out.cut_b) if keep_groups else None,
    )


# ---------------------------------------------------------------------- a training step's batch


def with_shaped_rewards(r: Rollouts, cfg: Config) -> Rollouts:
    """``r`` with its rewards after DAPO overlong shaping (``Rollouts.shaped``, float32 [N])."""
    loss = cfg.loss
    penalty = overlong_penalty(
        r.lengths, cfg.sampling.max_new_tokens, loss.overlong_buffer, loss.overlong_penalty
    )
    return dataclasses.replace(r, shaped=r.rewards + penalty)


def sample_step(
    sampler,
    params,
    prompts: StepPrompts,
    sizes: int | np.ndarray,
    key: jax.Array,
    *,
    cfg: Config,
    tail: TailBatcher | None,
) -> tuple[Rollouts, list[Rollouts]]:
    """(the training batch, every round sampled for it) of the step of ``prompts``: this
    process's share of P groups of G, or of the per-prompt ``sizes`` [P], their rewards shaped
    (``Rollouts.shaped``). Tail batching (``tail``) samples one round and trains on its first
    whole groups; otherwise see :func:`_sample_rounds`."""
    source, step = prompts.source, prompts.step
    num_prompts = prompts_for(cfg.train, sizes) if np.ndim(sizes) == 0 else len(sizes)
    settings = _generate_settings(cfg, prompts, num_prompts)
    if tail is None:
        return _sample_rounds(
            sampler, params, prompts, sizes, key, cfg=cfg, num_prompts=num_prompts, **settings
        )
    round_ = tail.next_round(source, step, num_prompts)  # or a long round's every group
    r = generate(
        sampler,
        params,
        source,
        round_.prompts,
        sizes,
        key,
        keep_groups=round_.keep_groups,
        **settings,
    )
    r = with_shaped_rewards(r, cfg)
    kept = tail.settle(round_, r.cut_p, step)
    return r.select_groups(kept), [r]


def _generate_settings(cfg: Config, prompts: StepPrompts, num_prompts: int) -> dict[str, Any]:
    """The keyword arguments of :func:`generate` that are the same for every round of a step."""
    s = cfg.sampling
    source = prompts.source
    settings = dict(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        buckets=source.prompt_buckets,  # sampling.prompt_buckets, 'auto' resolved
        reward_on_error=cfg.data.reward_on_error,
    )
    if source.rounds_per_step > 1:  # every round of the step gets one width
        settings["min_length"] = max(
            len(ids)
            for round_ in range(source.rounds_per_step)
            for ids in prompts.round(round_, num_prompts)[1]
        )
    return settings


def _sample_rounds(
    sampler,
    params,
    prompts: StepPrompts,
    sizes: int | np.ndarray,
    key: jax.Array,
    *,
    cfg: Config,
    num_prompts: int,
    **settings,
) -> tuple[Rollouts, list[Rollouts]]:
    """The first round; with ``loss.dynamic_sampling``, the informative groups (shaped rewards
    not all equal) of up to ``source.rounds_per_step`` rounds, until every process has its share
    of groups, filled up with the first round's zero-advantage groups to keep the shape.
    ``settings``: :func:`generate`'s keyword arguments."""
    source = prompts.source
    local_prompts = num_prompts // jax.process_count()  # this process's groups
    rounds = []
    kept: list[Rollouts] = []
    kept_groups = 0
    for round_ in range(source.rounds_per_step):
        round_prompts, encoded = prompts.round(round_, num_prompts)
        r = generate(
            sampler,
            params,
            source,
            round_prompts,
            sizes,
            jax.random.fold_in(key, round_),
            encoded=encoded,
            **settings,
        )
        r = with_shaped_rewards(r, cfg)
        rounds.append(r)
        if not cfg.loss.dynamic_sampling:
            return r, rounds
        informative = np.flatnonzero(informative_groups(r.shaped.reshape(-1, sizes)))
        take = informative[: local_prompts - kept_groups]
        if len(take):
            kept.append(r.select_groups(take))
            kept_groups += len(take)
        # Every process samples the same number of rounds (the sampler is one program).
        if not any_process(kept_groups < local_prompts):
            break
    if kept_groups < local_prompts:  # fill with zero-advantage groups to keep the shape
        first = rounds[0]
        spare = np.setdiff1d(
            np.arange(local_prompts),
            np.flatnonzero(informative_groups(first.shaped.reshape(-1, sizes))),
        )
        kept.append(first.select_groups(spare[: local_prompts - kept_groups]))
    return Rollouts.concat(kept), rounds
