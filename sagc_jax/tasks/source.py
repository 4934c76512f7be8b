"""Prompt sources for the trainer, one entry each in ``SOURCES`` (``data.task``'s choices; a
test keeps them equal): which prompts a step uses, how they become tokens, and their reward.
Problems are a pure function of (step, round, index), so a resumed run sees exactly the prompts
an uninterrupted one would have seen: the data position is the step counter (with tail batching,
a data cursor saved in the checkpoint: `programs/tail.py`). What every source shares (the base
class, the prompt length checks) is in ``tasks.prompt_source``; adding a source is a module with
its class and an entry here (docs/architecture.md, "Add a task source").
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sagc_jax.config import Config, ConfigError, Registry
from sagc_jax.tasks import CharTokenizer, DatasetError, SyntheticTask, load_dataset
from sagc_jax.tasks.datasets import shard_rows
from sagc_jax.tasks.prompt_source import (
    LengthCheck,
    Prompt,
    PromptSource,
    RowSource,
    check_tokenizer,
    epoch_order,
    model_limits,
    prompt_limit,
)
from sagc_jax.tasks.reasoning_gym import ReasoningGymSource
from sagc_jax.tasks.reasoning_gym import data_identity as reasoning_gym_identity


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
        self._resolve_buckets(cfg, (shortest, longest, limit), [], log)

    def _train_prompt(self, position: int, step: int) -> Prompt:
        cap = None
        if self.curriculum_steps:
            cap = self.task.curriculum_terms(
                step, self.curriculum_steps, self.curriculum_start_terms
            )
        index = position
        if self.prompt_pool:
            index = epoch_order(self._orders, self.seed, position, self.prompt_pool)
        p = self.task.problem(index, "train", cap)
        return Prompt(p.prompt, p.answer, index)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(p.prompt, p.answer, i) for i, p in enumerate(self.task.heldout(num))]

    def encode(self, prompt: Prompt) -> list[int]:
        return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt.text)]

    def sft_pairs(self, count: int, start: int) -> list[tuple[str, str]]:
        return self.task.sft_pairs(count, start)


class DatasetSource(RowSource):
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
        check_tokenizer(cfg, tokenizer)
        limit, why = prompt_limit(cfg)
        train = LengthCheck(self.encode, limit, why, d.on_long_prompt, self.chat_template)
        rows = load_dataset(d.path, keep=train)
        held = train
        if d.eval_path:
            held = LengthCheck(self.encode, limit, why, d.on_long_prompt, self.chat_template)
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
        notes += [
            f"data: skipped {check.skipped} of {check.seen} rows of {path}: prompts over "
            f"{limit} tokens ({why}; data.on_long_prompt: skip)"
            for path, check in ((d.path, train), (d.eval_path, held))
            if check.skipped and path
        ]
        self._keep_run_settings(cfg, "math", rounds_per_step, shard_index, num_shards)
        self._resolve_buckets(cfg, (shortest, longest, limit), notes, log)

    def _shard_start(self, first: int, num_prompts: int) -> int:
        return first // self.num_shards  # each shard walks through its own rows

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


def file_identity(cfg: Config) -> dict[str, dict]:
    """What a checkpoint records of the data files (``data.path``, ``data.eval_path``): per key,
    the path, its size and the sha256 of its contents."""
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


# (cfg, tokenizer, rollout rounds per step, shard index, shards, log) -> the source
Build = Callable[..., PromptSource]


@dataclasses.dataclass(frozen=True)
class SourceEntry:
    """One prompt source (``data.task``): ``build`` makes it; ``identity`` is what a checkpoint
    records of its data (compared on resume), ``{}`` where the config says it all; ``help``: its
    line in ``data.task``'s help; ``tokenizer``: its own tokenizer's class, which the preset
    model is sized to, or None where it reads the model's (``model.tokenizer`` or
    ``hf_checkpoint``, handed to ``build``); ``sharded``: each process reads its own shard of
    the rows, so a resume must keep the number of processes."""

    cls: type[PromptSource]
    build: Build
    identity: Callable[[Config], dict[str, dict]]
    help: str
    tokenizer: Callable[[], Any] | None = None
    sharded: bool = False


SOURCES = Registry(
    "data.task",
    {
        "synthetic": SourceEntry(
            SyntheticSource,
            lambda cfg, _tokenizer, *shard: SyntheticSource(cfg, *shard),  # its own tokenizer
            lambda cfg: {},  # its parameters are in the config, which a resume compares
            "the built-in running-sum task",
            tokenizer=CharTokenizer,
        ),
        "dataset": SourceEntry(
            DatasetSource,
            DatasetSource,
            file_identity,
            "data.path with your own rows",
            sharded=True,  # each process walks its own shard of the rows
        ),
        "reasoning_gym": SourceEntry(
            ReasoningGymSource,
            ReasoningGymSource,
            reasoning_gym_identity,
            "a reasoning-gym dataset (data.rg_dataset; pip install 'sagc-jax[rg]')",
        ),
    }.items(),
)


def make_source(
    cfg: Config, tokenizer=None, shard_index: int = 0, num_shards: int = 1, log=print
) -> PromptSource:
    """The run's prompt source (``SOURCES[data.task]``), its prompts checked and
    ``prompt_buckets`` resolved; ``log`` gets the notes of process 0 (rows skipped, ``auto``
    buckets)."""
    rounds = cfg.loss.max_sampling_rounds if cfg.loss.dynamic_sampling else 1
    return SOURCES[cfg.data.task].build(cfg, tokenizer, rounds, shard_index, num_shards, log)


def data_identity(cfg: Config) -> dict[str, dict]:
    """What a checkpoint records of the run's data (``SOURCES[data.task].identity``): for a
    data file its path, size and sha256; for a reasoning-gym task its dataset name, keyword
    arguments, sizes, seeds and reasoning-gym version; nothing for the synthetic task."""
    return SOURCES[cfg.data.task].identity(cfg)
