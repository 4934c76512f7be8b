"""Prompt sources for the trainer: which prompts a step uses, how they become tokens, and their
reward. Problems are a pure function of (step, round, index), so a resumed run sees exactly the
prompts an uninterrupted one would have seen: the data position is the step counter (with tail
batching, a data cursor saved in the checkpoint: `programs/tail.py`).

Every prompt is measured before step 0, as the sampler will see it (`PromptSource.encode`): a
dataset row that is empty or too long for the largest prompt bucket (or for the model's
positions with ``sampling.max_new_tokens`` after it) stops the run at load time naming its file
and line, or is skipped (``data.on_long_prompt: skip``). ``sampling.prompt_buckets: auto`` is
resolved here, from those lengths, into `PromptSource.prompt_buckets`: what the sampler, the
evaluation and the plan use.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sagc_jax.config import Config, ConfigError
from sagc_jax.tasks import CharTokenizer, DatasetError, SyntheticTask, load_dataset, resolve_reward
from sagc_jax.tasks.datasets import shard_rows


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


class SyntheticSource(PromptSource):
    """The built-in running-sum task with its character tokenizer.

    With ``data.curriculum_steps > 0`` the training prompts of step t have at most
    ``task.curriculum_terms(t, ...)`` terms, rising from ``data.curriculum_start_terms`` to
    ``data.max_terms``; held-out and SFT prompts are never capped.
    """

    def __init__(
        self, cfg: Config, rounds_per_step: int = 1, shard_index=0, num_shards=1, log=print
    ):
        d = cfg.data
        self.task = SyntheticTask(
            min_terms=d.min_terms,
            max_terms=d.max_terms,
            min_digits=d.min_digits,
            max_digits=d.max_digits,
            modulus=d.modulus,
            seed=d.seed,
        )
        self.curriculum_steps = d.curriculum_steps
        self.curriculum_start_terms = d.curriculum_start_terms
        self.prompt_pool = d.prompt_pool
        self.tokenizer = CharTokenizer()
        _check_char_vocabulary(cfg, self.tokenizer)
        self._keep_run_settings(cfg, "synthetic", rounds_per_step, shard_index, num_shards)
        # Prompts are bounded by construction: bos, then every term's digits and a sign after it.
        longest = 1 + self.task.max_prompt_chars()
        shortest = 1 + d.min_terms * (d.min_digits + 1)
        limit, why = prompt_limit(cfg)
        if longest > limit:
            raise ConfigError(
                f"synthetic prompts reach {longest} tokens (bos, data.max_terms = {d.max_terms} "
                f"terms of up to data.max_digits = {d.max_digits} digits, a sign after each); at "
                f"most {limit} fit ({why}); raise sampling.prompt_buckets (or set it to auto) or "
                f"lower data.max_terms / data.max_digits"
            )
        self.prompt_buckets = resolve_buckets(cfg, shortest, longest, limit)
        if cfg.sampling.prompt_buckets == "auto" and shard_index == 0:
            log(_auto_note(self.prompt_buckets, shortest, longest))

    def _train_prompt(self, position: int, step: int) -> Prompt:
        cap = None
        if self.curriculum_steps:
            cap = self.task.curriculum_terms(
                step, self.curriculum_steps, self.curriculum_start_terms
            )
        index = position
        if self.prompt_pool:
            index = _epoch_order(self._orders, self.seed, position, self.prompt_pool)
        p = self.task.problem(index, "train", cap)
        return Prompt(p.prompt, p.answer, index)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(p.prompt, p.answer, i) for i, p in enumerate(self.task.heldout(num))]

    def encode(self, prompt: Prompt) -> list[int]:
        return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt.text)]

    def sft_pairs(self, count: int, start: int) -> list[tuple[str, str]]:
        return self.task.sft_pairs(count, start)


class DatasetSource(PromptSource):
    """Rows ``{prompt, answer}`` of a JSONL/Parquet file, reshuffled every epoch.

    The held-out prompts are ``data.eval_path``'s rows, or, without one, ``data.eval_split``
    rows of ``data.path`` drawn by ``data.seed`` and never trained on (nor is any other row with
    the same prompt): disjoint from training by construction. Every process reads every row and
    makes the same split; in multi-process runs each then keeps only its shard of the training
    rows (``shard_index`` of ``num_shards``) and walks through it on its own: its prompts are a
    function of (step, round, index) within the shard. As every process tokenises every row,
    all processes fail on the same row, skip the same rows, shard the same way and derive the
    same ``auto`` buckets, with no collective.
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        rounds_per_step: int = 1,
        shard_index: int = 0,
        num_shards: int = 1,
        log=print,
    ):
        d = cfg.data
        self.tokenizer = tokenizer
        notes = []
        self.chat_template = d.chat_template
        if self.chat_template is None:  # a chat model gets its template unless told otherwise
            self.chat_template = getattr(tokenizer, "chat_template", None) is not None
            if self.chat_template:
                notes.append(
                    "data: prompts go through the tokenizer's chat template (data.chat_template "
                    "unset and the tokenizer has one; set it to false for raw prompts)"
                )
        _check_tokenizer(cfg, tokenizer)
        limit, why = prompt_limit(cfg)
        train = _LengthCheck(self.encode, limit, why, d.on_long_prompt, self.chat_template)
        rows = load_dataset(d.path, keep=train)
        held = train
        if d.eval_path:
            held = _LengthCheck(self.encode, limit, why, d.on_long_prompt, self.chat_template)
            self.eval_rows = load_dataset(d.eval_path, keep=held)
            seen = {r.prompt for r in rows}
            shared = sum(r.prompt in seen for r in self.eval_rows)
            if shared:
                notes.append(
                    f"data: {shared} of the {len(self.eval_rows)} rows of data.eval_path "
                    f"{d.eval_path} have a prompt that data.path also has: the evaluation is "
                    f"not wholly held out"
                )
        elif d.eval_split:
            self.eval_rows, rows, dropped = split_heldout(rows, d.eval_split, d.seed, d.path)
            notes.append(
                f"data: held-out: {len(self.eval_rows)} rows of {d.path} drawn by data.seed = "
                f"{d.seed} (data.eval_split), never trained on"
                + (f"; {dropped} more rows with a held-out prompt left out" if dropped else "")
            )
        else:
            self.eval_rows = rows
            notes.append(
                f"data: the evaluation reads the first rows of the training file {d.path} "
                f"(data.eval_split = 0, no data.eval_path): its accuracy is not held-out"
            )
        self.rows = shard_rows(rows, shard_index, num_shards, d.path, "{} training rows")
        shortest, longest = min(train.shortest, held.shortest), max(train.longest, held.longest)
        self.prompt_buckets = resolve_buckets(cfg, shortest, longest, limit)
        notes += [
            f"data: skipped {check.skipped} of {check.seen} rows of {path}: prompts over "
            f"{limit} tokens ({why}; data.on_long_prompt: skip)"
            for path, check in ((d.path, train), (d.eval_path, held))
            if check.skipped and path
        ]
        if cfg.sampling.prompt_buckets == "auto":
            notes.append(_auto_note(self.prompt_buckets, shortest, longest))
        if shard_index == 0:  # every process knows the same: one says it
            for note in dict.fromkeys(notes):
                log(note)
        self._keep_run_settings(cfg, "math", rounds_per_step, shard_index, num_shards)

    def _shard_start(self, first: int, num_prompts: int) -> int:
        return first // self.num_shards  # each shard walks through its own rows

    def _train_prompt(self, position: int, step: int) -> Prompt:
        del step  # rows are reshuffled by epoch; no curriculum
        row = self.rows[_epoch_order(self._orders, self.seed, position, len(self.rows))]
        return Prompt(row.prompt, row.answer, row.index)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(r.prompt, r.answer, r.index) for r in self.eval_rows[:num]]

    def encode(self, prompt: Prompt) -> list[int]:
        if self.chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}],
                add_generation_prompt=True,
                tokenize=True,
            )
        return self.tokenizer.encode(prompt.text, add_special_tokens=True)


def split_heldout(rows: list, size: int, seed: int, path) -> tuple[list, list, int]:
    """(held-out rows, training rows, rows dropped): ``size`` rows drawn by ``seed`` (in file
    order), and the others but those whose prompt a held-out row has. DatasetError when no
    training row is left."""
    if size >= len(rows):
        raise DatasetError(
            f"{path}: data.eval_split = {size} held-out rows leave none of its {len(rows)} rows "
            f"to train on; lower data.eval_split or give a held-out file as data.eval_path"
        )
    chosen = np.zeros(len(rows), bool)
    chosen[np.random.default_rng([seed, len(rows)]).choice(len(rows), size, replace=False)] = True
    held = [r for r, c in zip(rows, chosen, strict=True) if c]
    prompts = {r.prompt for r in held}
    train = [r for r, c in zip(rows, chosen, strict=True) if not c and r.prompt not in prompts]
    if not train:
        raise DatasetError(
            f"{path}: every row not held out (data.eval_split = {size}) repeats a held-out "
            f"prompt; nothing is left to train on"
        )
    return held, train, len(rows) - size - len(train)


def _epoch_order(orders: dict[int, np.ndarray], seed: int, position: int, size: int) -> int:
    """Index in ``[0, size)`` of data ``position``: every epoch of ``size`` positions visits
    each index once, in an order seeded by (seed, epoch); ``orders`` caches the last epoch's."""
    epoch, offset = divmod(position, size)
    if epoch not in orders:
        rng = np.random.default_rng([seed, epoch])
        orders.clear()
        orders[epoch] = rng.permutation(size)
    return int(orders[epoch][offset])


def make_source(
    cfg: Config, tokenizer=None, shard_index: int = 0, num_shards: int = 1, log=print
) -> PromptSource:
    """The run's prompt source, its prompts checked and ``prompt_buckets`` resolved; ``log``
    gets the notes of process 0 (rows skipped, ``auto`` buckets)."""
    rounds = cfg.loss.max_sampling_rounds if cfg.loss.dynamic_sampling else 1
    if cfg.data.task == "synthetic":
        return SyntheticSource(cfg, rounds, shard_index, num_shards, log)
    if cfg.data.task == "reasoning_gym":
        from sagc_jax.tasks.reasoning_gym import ReasoningGymSource

        return ReasoningGymSource(cfg, tokenizer, rounds, shard_index, num_shards, log)
    return DatasetSource(cfg, tokenizer, rounds, shard_index, num_shards, log)


def data_identity(cfg: Config) -> dict[str, dict]:
    """What a checkpoint records of the data files (``data.path``, ``data.eval_path``): per key,
    the path, its size and the sha256 of its contents. The synthetic task has none (its
    parameters are in the config, which a resume compares); a reasoning-gym task's is its
    dataset name, keyword arguments, sizes, seeds and reasoning-gym version."""
    if cfg.data.task == "synthetic":
        return {}
    if cfg.data.task == "reasoning_gym":
        from sagc_jax.tasks.reasoning_gym import data_identity as reasoning_gym_identity

        return reasoning_gym_identity(cfg)
    identity = {}
    for key in ("path", "eval_path"):
        path = getattr(cfg.data, key)
        if path:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            size = Path(path).stat().st_size
            identity[f"data.{key}"] = {"path": path, "size": size, "sha256": digest.hexdigest()}
    return identity


def with_resolved_buckets(cfg: Config, source: PromptSource) -> Config:
    """``cfg`` with ``sampling.prompt_buckets`` replaced by the source's concrete buckets."""
    sampling = dataclasses.replace(cfg.sampling, prompt_buckets=source.prompt_buckets)
    return dataclasses.replace(cfg, sampling=sampling)


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


def _check_tokenizer(cfg: Config, tokenizer) -> None:
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


def _check_char_vocabulary(cfg: Config, tokenizer: CharTokenizer) -> None:
    """A Hugging Face checkpoint whose embedding has more rows than the character tokenizer has
    ids is refused: a rollout may draw an extra id, which it cannot decode. (A preset is sized
    to the tokenizer; a Hugging Face tokenizer with fewer ids than rows, a padded vocabulary
    such as Qwen2.5's 151,936 rows over 151,665 ids, decodes such ids to "".)"""
    if not cfg.model.hf_checkpoint:
        return
    _, rows, name = model_limits(cfg)
    ids = tokenizer.vocab_size
    if rows > ids:
        raise ConfigError(
            f"{name}: its embedding has {rows} rows but the synthetic task's character "
            f"tokenizer has {ids} ids; a rollout could draw an id from {ids} to {rows - 1}, "
            f"which it cannot decode; use data.task=dataset with the checkpoint's tokenizer, "
            f"or a model.preset (sized to the {ids} ids) for the synthetic task"
        )


class _LengthCheck:
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
