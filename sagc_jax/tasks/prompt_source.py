"""What every prompt source shares: a ``Prompt``, the ``PromptSource`` base (the step's prompts
per shard, the run settings every source keeps, the shared end of start-up: buckets resolved and
notes said once), ``RowSource`` for sources of fixed rows reshuffled every epoch, and the prompt
length checks (``prompt_limit``, ``LengthCheck``, ``resolve_buckets``).

Every prompt is measured before step 0, as the sampler will see it (`PromptSource.encode`): a
row that is empty or too long for the largest prompt bucket (or for the model's positions with
``sampling.max_new_tokens`` after it) stops the run at load time naming its file and line, or is
skipped (``data.on_long_prompt: skip``). ``sampling.prompt_buckets: auto`` is resolved from those
lengths into `PromptSource.prompt_buckets`: what the sampler, the evaluation and the plan use.
The sources themselves and their registry are in ``tasks.source``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sagc_jax.config import Config, ConfigError
from sagc_jax.tasks import DatasetError, resolve_reward


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    id: int  # stable across epochs and processes: dataset row, synthetic pool or stream index


class PromptSource:
    """Base class: ``batch`` / ``heldout`` give prompts; ``encode`` turns one into token ids.

    Multi-process runs build one source per process (``shard_index`` of ``num_shards``) and
    ``batch`` gives that process its share of the step's prompts.
    """

    tokenizer: object
    reward_fn: Callable
    prompt_buckets: tuple[int, ...]  # sampling.prompt_buckets, with 'auto' resolved
    rounds_per_step: int = 1
    shard_index: int = 0
    num_shards: int = 1

    def _keep_run_settings(
        self, cfg: Config, task_reward: str, rounds_per_step: int, shard_index: int, num_shards: int
    ) -> None:
        """What every source keeps of the run: its reward function (``task_reward`` when
        data.reward is 'auto'), the rollout rounds of a step, its shard, the data order's seed."""
        d = cfg.data
        self.reward_fn = resolve_reward(
            task_reward if d.reward == "auto" else d.reward,
            timeout_s=d.math_timeout_s,
            batch_timeout_s=d.math_batch_timeout_s,
            workers=d.math_workers,
            reward_timeout_s=d.reward_timeout_s,
        )
        self.rounds_per_step = rounds_per_step
        self.shard_index, self.num_shards = shard_index, num_shards
        self.seed = d.seed
        self._orders: dict[int, np.ndarray] = {}

    def _resolve_buckets(
        self, cfg: Config, lengths: tuple[int, int, int], notes: list[str], log
    ) -> None:
        """The shared end of a source's start-up: ``prompt_buckets`` as configured or, ``auto``,
        from the prompts' (shortest, longest) token counts under ``limit`` (``lengths``), and the
        source's notes said once, by the first shard (every process knows the same)."""
        shortest, longest, limit = lengths
        self.prompt_buckets = resolve_buckets(cfg, shortest, longest, limit)
        if cfg.sampling.prompt_buckets == "auto":
            notes.append(_auto_note(self.prompt_buckets, shortest, longest))
        if self.shard_index == 0:
            for note in dict.fromkeys(notes):
                log(note)

    def _train_prompt(self, position: int, step: int) -> Prompt:
        """The training prompt at data ``position``, drawn for training step ``step`` (a source
        may use the step, e.g. for a curriculum; the prompt stays a function of both)."""
        raise NotImplementedError

    def _shard_start(self, first: int, num_prompts: int) -> int:
        """This shard's first position of the global positions [first, first + num_prompts):
        its slice of them."""
        return first + self.shard_index * (num_prompts // self.num_shards)

    def positions(self, first: int, num_prompts: int) -> list[int]:
        """This shard's positions among the global data positions [first, first + num_prompts)
        (``num_prompts`` counts every shard's)."""
        if num_prompts % self.num_shards:
            raise ValueError(f"{num_prompts} prompts cannot be split into {self.num_shards} shards")
        start = self._shard_start(first, num_prompts)
        return list(range(start, start + num_prompts // self.num_shards))

    def prompt_at(self, position: int, step: int) -> Prompt:
        """The training prompt of this shard at ``position``, drawn for step ``step``."""
        return self._train_prompt(position, step)

    def batch(self, step: int, round_: int, num_prompts: int) -> list[Prompt]:
        """This shard's ``num_prompts / num_shards`` prompts of rollout round ``round_`` of step
        ``step`` (rounds > 0: dynamic sampling); ``num_prompts`` counts every shard's."""
        first = (step * self.rounds_per_step + round_) * num_prompts
        return [self._train_prompt(i, step) for i in self.positions(first, num_prompts)]

    def heldout(self, num: int) -> list[Prompt]:
        raise NotImplementedError

    def encode(self, prompt: Prompt) -> list[int]:
        raise NotImplementedError


class RowSource(PromptSource):
    """A source of fixed rows (``rows``: ``datasets.Example``; ``eval_rows`` held out), the
    training rows reshuffled every epoch by ``data.seed``, no curriculum."""

    rows: list
    eval_rows: list

    def _train_prompt(self, position: int, step: int) -> Prompt:
        del step  # rows are reshuffled by epoch; no curriculum
        row = self.rows[epoch_order(self._orders, self.seed, position, len(self.rows))]
        return Prompt(row.prompt, row.answer, row.index)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(r.prompt, r.answer, r.index) for r in self.eval_rows[:num]]


def epoch_order(orders: dict[int, np.ndarray], seed: int, position: int, size: int) -> int:
    """Index in ``[0, size)`` of data ``position``: every epoch of ``size`` positions visits
    each index once, in an order seeded by (seed, epoch); ``orders`` caches the last epoch's."""
    epoch, offset = divmod(position, size)
    if epoch not in orders:
        rng = np.random.default_rng([seed, epoch])
        orders.clear()
        orders[epoch] = rng.permutation(size)
    return int(orders[epoch][offset])


# --------------------------------------------------------------------------- prompt lengths


def model_limits(cfg: Config) -> tuple[int, int, str]:
    """(positions, vocabulary size, name) of the configured model, without building it."""
    m = cfg.model
    if m.hf_checkpoint:
        from sagc_jax.models.hf_checkpoint import read_hf_config

        hf = read_hf_config(m.hf_checkpoint)  # one line naming the file if it is bad
        name = f"model.hf_checkpoint {m.hf_checkpoint}"
        # the defaults of models.architecture.DecoderConfig.from_hf_config (0: no vocabulary check)
        return int(hf.get("max_position_embeddings", 2048)), int(hf.get("vocab_size", 0)), name
    from sagc_jax.models import get_preset

    try:
        arch = get_preset(m.preset)
    except ValueError as err:
        raise ConfigError(f"model.preset = {m.preset!r}: {err}") from None
    return arch.max_position_embeddings, arch.vocab_size, f"model.preset {m.preset}"


def prompt_limit(cfg: Config) -> tuple[int, str]:
    """The most tokens a prompt may have, and where that limit comes from (for messages).

    A prompt is padded to its bucket and followed by ``sampling.max_new_tokens``, and the two
    must fit the model's positions: the limit is the largest bucket that does (``auto``: the
    positions left after ``max_new_tokens``). Raises ConfigError when no bucket fits.
    """
    s = cfg.sampling
    positions, _, name = model_limits(cfg)
    room = positions - s.max_new_tokens
    context = f"{name} has {positions} positions, sampling.max_new_tokens = {s.max_new_tokens}"
    if room < 1:
        raise ConfigError(f"no room for a prompt: {context}; lower sampling.max_new_tokens")
    if s.prompt_buckets == "auto":
        return room, context
    fitting = [b for b in s.prompt_buckets if b <= room]
    if not fitting:
        raise ConfigError(
            f"sampling.prompt_buckets = {list(s.prompt_buckets)}: even the smallest leaves no "
            f"room ({context}); use smaller buckets or fewer new tokens"
        )
    if fitting[-1] == s.prompt_buckets[-1]:
        return fitting[-1], "the largest sampling.prompt_buckets entry"
    return fitting[-1], f"the largest sampling.prompt_buckets entry that fits: {context}"


def auto_buckets(shortest: int, longest: int, limit: int, rungs: int = 4) -> tuple[int, ...]:
    """Up to ``rungs`` buckets: the longest prompt rounded up to a multiple of 8 (at most
    ``limit``), then halving (rounded up to 8) while a rung still holds the shortest prompt."""
    top = min(-(-longest // 8) * 8, limit)
    out = [top]
    while len(out) < rungs:
        half = -(-out[-1] // 16) * 8  # half, rounded up to a multiple of 8
        if half >= out[-1] or half < shortest:
            break
        out.append(half)
    return tuple(sorted(out))


def resolve_buckets(cfg: Config, shortest: int, longest: int, limit: int) -> tuple[int, ...]:
    """``sampling.prompt_buckets`` as a tuple: as configured, or derived from the lengths."""
    if cfg.sampling.prompt_buckets == "auto":
        return auto_buckets(shortest, longest, limit)
    return tuple(cfg.sampling.prompt_buckets)


def _auto_note(buckets: tuple[int, ...], shortest: int, longest: int) -> str:
    return (
        f"data: sampling.prompt_buckets auto -> {list(buckets)} "
        f"(prompts of {shortest} to {longest} tokens)"
    )


def check_tokenizer(cfg: Config, tokenizer) -> None:
    """A tokenizer the sampler can use: an end token, and ids the model's embedding has."""
    check = getattr(tokenizer, "check_special_tokens", None)
    if check is not None:
        check()
    elif tokenizer.eos_id is None:
        raise ConfigError("the tokenizer has no eos token (model.tokenizer)")
    _, vocab, name = model_limits(cfg)
    if 0 < vocab < tokenizer.vocab_size:
        where = getattr(tokenizer, "path", None) or "the tokenizer"
        raise ConfigError(
            f"{where}: {tokenizer.vocab_size} tokens, more than the {vocab} embeddings of {name}; "
            f"use a smaller tokenizer (sagc-jax tokenizer --vocab-size {vocab}) or a larger model"
        )


class LengthCheck:
    """The ``keep`` filter of `load_dataset`: tokenises each row's prompt as the sampler will and
    stops at (or, ``on_long == 'skip'``, leaves out) a prompt too long; keeps only counts."""

    def __init__(self, encode, limit: int, why: str, on_long: str, chat_template: bool):
        self.encode, self.limit, self.why, self.on_long = encode, limit, why, on_long
        self.form = " with the chat template" if chat_template else ""
        self.seen = self.skipped = 0
        self.shortest, self.longest = limit, 0

    def __call__(self, row) -> bool:
        self.seen += 1
        try:
            n = len(self.encode(Prompt(row.prompt, row.answer, row.index)))
        except Exception as err:  # a template or tokenizer error: still one line, with the row
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DatasetError(f"{row.where}: cannot tokenise the prompt ({reason})") from None
        if n == 0:
            raise DatasetError(
                f"{row.where}: the prompt is empty (0 tokens{self.form}); every prompt needs a "
                f"token: fill in the row or drop it"
            )
        if n > self.limit:
            if self.on_long == "skip":
                self.skipped += 1
                return False
            raise DatasetError(
                f"{row.where}: the prompt has {n} tokens{self.form}, over the limit of "
                f"{self.limit} ({self.why}); shorten or drop the row, raise "
                f"sampling.prompt_buckets (or set it to auto), or set data.on_long_prompt=skip"
            )
        self.shortest, self.longest = min(self.shortest, n), max(self.longest, n)
        return True
