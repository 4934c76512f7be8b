"""Prompt sources for the trainer: which prompts a step uses, how they become tokens, and their
reward. Problems are a pure function of (step, round, index), so a resumed run sees exactly the
prompts an uninterrupted one would have seen: the data position is the step counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sagc_jax.config import Config
from sagc_jax.tasks import CharTokenizer, SyntheticTask, load_dataset, resolve_reward


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


class PromptSource:
    """Base class: ``batch`` / ``heldout`` give prompts; ``encode`` turns one into token ids.

    Multi-process runs build one source per process (``shard_index`` of ``num_shards``) and
    ``batch`` gives that process its share of the step's prompts.
    """

    tokenizer: object
    reward_fn: Callable
    rounds_per_step: int = 1
    shard_index: int = 0
    num_shards: int = 1

    def _train_prompt(self, position: int) -> Prompt:
        raise NotImplementedError

    def _first_position(self, step: int, round_: int, num_prompts: int) -> int:
        """Position of this shard's first prompt: its slice of the global batch."""
        local = num_prompts // self.num_shards
        return (step * self.rounds_per_step + round_) * num_prompts + self.shard_index * local

    def batch(self, step: int, round_: int, num_prompts: int) -> list[Prompt]:
        """This shard's ``num_prompts / num_shards`` prompts of rollout round ``round_`` of step
        ``step`` (rounds > 0: dynamic sampling); ``num_prompts`` counts every shard's."""
        if num_prompts % self.num_shards:
            raise ValueError(f"{num_prompts} prompts cannot be split into {self.num_shards} shards")
        start = self._first_position(step, round_, num_prompts)
        return [self._train_prompt(start + i) for i in range(num_prompts // self.num_shards)]

    def heldout(self, num: int) -> list[Prompt]:
        raise NotImplementedError

    def encode(self, prompt: Prompt) -> list[int]:
        raise NotImplementedError


class SyntheticSource(PromptSource):
    """The built-in running-sum task with its character tokenizer."""

    def __init__(self, cfg: Config, rounds_per_step: int = 1, shard_index=0, num_shards=1):
        d = cfg.data
        self.task = SyntheticTask(
            min_terms=d.min_terms,
            max_terms=d.max_terms,
            min_digits=d.min_digits,
            max_digits=d.max_digits,
            modulus=d.modulus,
            seed=d.seed,
        )
        self.tokenizer = CharTokenizer()
        self.reward_fn = resolve_reward("synthetic" if d.reward == "auto" else d.reward)
        self.rounds_per_step = rounds_per_step
        self.shard_index, self.num_shards = shard_index, num_shards

    def _train_prompt(self, position: int) -> Prompt:
        p = self.task.problem(position, "train")
        return Prompt(p.prompt, p.answer)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(p.prompt, p.answer) for p in self.task.heldout(num)]

    def encode(self, prompt: Prompt) -> list[int]:
        return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt.text)]

    def sft_pairs(self, count: int, start: int) -> list[tuple[str, str]]:
        return self.task.sft_pairs(count, start)


class DatasetSource(PromptSource):
    """Rows ``{prompt, answer}`` of a JSONL/Parquet file, reshuffled every epoch.

    In multi-process runs each process loads only its shard of the rows (``shard_index`` of
    ``num_shards``) and walks through it on its own: its prompts are a function of (step, round,
    index) within the shard.
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        rounds_per_step: int = 1,
        shard_index: int = 0,
        num_shards: int = 1,
    ):
        d = cfg.data
        self.rows = load_dataset(d.path, shard_index=shard_index, num_shards=num_shards)
        # Held-out prompts must be the same list on every process: without an eval file, the
        # head of the whole training file (not of this process's shard).
        if d.eval_path or num_shards > 1:
            self.eval_rows = load_dataset(d.eval_path or d.path)
        else:
            self.eval_rows = self.rows
        self.tokenizer = tokenizer
        self.reward_fn = resolve_reward("math" if d.reward == "auto" else d.reward)
        self.rounds_per_step = rounds_per_step
        self.shard_index, self.num_shards = shard_index, num_shards
        self.chat_template = d.chat_template
        self.seed = d.seed
        self._orders: dict[int, np.ndarray] = {}

    def _first_position(self, step: int, round_: int, num_prompts: int) -> int:
        return (step * self.rounds_per_step + round_) * (num_prompts // self.num_shards)

    def _train_prompt(self, position: int) -> Prompt:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.rows))}
        row = self.rows[int(self._orders[epoch][offset])]
        return Prompt(row.prompt, row.answer)

    def heldout(self, num: int) -> list[Prompt]:
        return [Prompt(r.prompt, r.answer) for r in self.eval_rows[:num]]

    def encode(self, prompt: Prompt) -> list[int]:
        if self.chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}],
                add_generation_prompt=True,
                tokenize=True,
            )
        return self.tokenizer.encode(prompt.text, add_special_tokens=True)


def make_source(cfg: Config, tokenizer=None, shard_index: int = 0, num_shards: int = 1):
    rounds = cfg.loss.max_sampling_rounds if cfg.loss.dynamic_sampling else 1
    if cfg.data.task == "synthetic":
        return SyntheticSource(cfg, rounds, shard_index, num_shards)
    return DatasetSource(cfg, tokenizer, rounds, shard_index, num_shards)
