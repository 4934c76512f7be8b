"""reasoning-gym tasks (``data.task: reasoning_gym``): procedurally generated reasoning problems
with their own verifiers, from the optional ``reasoning-gym`` package (``pip install
'sagc-jax[rg]'``).

The training split is ``reasoning_gym.create_dataset(data.rg_dataset, seed=data.seed,
size=data.rg_train_size, **data.rg_config)``, the held-out split the same with
``data.rg_eval_seed`` and ``data.rg_eval_size``, less the held-out entries whose question is
also a training one (disjoint by construction). Every process generates both splits whole (they
are a pure function of the config), so the prompts of a step are a function of the global data
position, whatever the number of processes. Prompts are the question under reasoning-gym's
default system prompt (the final answer inside ``<answer></answer>`` tags), rendered through the
tokenizer's chat template.

The reward (:func:`score`, ``sagc_jax.tasks.reasoning_gym:score``, what ``data.reward: auto``
picks) is the dataset's own ``score_answer`` of the answer extracted from the completion
(``reasoning_gym.utils.extract_answer``): 1.0 for a right answer, partial credit below 1. It
runs in the reward worker under ``data.reward_timeout_s``. A prompt's ``answer`` string carries
what it needs: JSON ``{"rg": name, "config": kwargs, "entry": entry}``, or, for an entry that
does not survive a JSON round trip, the key that re-creates it (``seed``, ``size``, ``index``).

This module imports without reasoning-gym installed; building a source or scoring then fails
with one line naming the install.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from sagc_jax.config import Config, ConfigError
from sagc_jax.tasks.datasets import Example
from sagc_jax.tasks.math_checker import extract_answer as final_answer
from sagc_jax.tasks.prompt_source import (
    LengthCheck,
    Prompt,
    RowSource,
    check_tokenizer,
    prompt_limit,
)

__all__ = ["SCORE_SPEC", "ReasoningGymSource", "data_identity", "score"]

#: The reward ``data.reward: auto`` picks for this task (run in the time-limited worker).
SCORE_SPEC = "sagc_jax.tasks.reasoning_gym:score"
#: reasoning-gym's system prompt the prompts are rendered with (reasoning_gym.utils.SYSTEM_PROMPTS).
SYSTEM_PROMPT = "default"
INSTALL = "pip install 'sagc-jax[rg]'"
# Config fields the source sets itself (data.seed, data.rg_*_size): not allowed in data.rg_config.
_OWN_KEYS = ("seed", "size")


def _reasoning_gym():
    """The reasoning_gym package, or a one-line ConfigError naming the install."""
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"data.task = 'reasoning_gym' needs the reasoning-gym package ({err}): {INSTALL}"
        ) from None
    return reasoning_gym


def _kwargs(cfg: Config) -> dict[str, Any]:
    return dict(cfg.data.rg_config or {})


def check_dataset(name: str, kwargs: dict[str, Any]) -> None:
    """A registered dataset name and keyword arguments its config class has, or a one-line
    ConfigError naming the key and what is allowed."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ConfigError(
            f"data.rg_dataset = {name!r} is not a reasoning-gym dataset; allowed: "
            f"{', '.join(sorted(DATASETS))}"
        )
    _, config_cls = DATASETS[name]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_KEYS]
    for key in kwargs:
        if key in _OWN_KEYS:
            raise ConfigError(
                f"data.rg_config.{key} is set by the trainer (data.seed / data.rg_eval_seed, "
                f"data.rg_train_size / data.rg_eval_size); allowed keys of {name}: "
                f"{', '.join(fields)}"
            )
        if key not in fields:
            raise ConfigError(
                f"data.rg_config.{key} is not a keyword argument of reasoning-gym's {name}; "
                f"allowed: {', '.join(fields)}"
            )


def _create(name: str, kwargs: dict[str, Any], seed: int, size: int):
    """The dataset, or a one-line ConfigError when its config rejects the values."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except Exception as err:  # the config's validate(): assertions, value errors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"data.rg_config = {json.dumps(kwargs, sort_keys=True, default=str)}: reasoning-gym's "
            f"{name} rejects it ({reason})"
        ) from None


def _answer(
    name: str, kwargs: dict, seed: int, size: int, index: int, entry: dict, extract: str
) -> str:
    """The ``answer`` string of an entry: the entry itself as JSON when it survives the round
    trip unchanged, else the key that re-creates it; with ``extract`` (``data.rg_answer``)
    when it is not the default."""
    head = {"rg": name, "config": kwargs, **({"extract": extract} if extract != "tags" else {})}
    try:
        text = json.dumps(entry, sort_keys=True)
        if json.loads(text) == entry:
            return json.dumps({**head, "entry": entry}, sort_keys=True)
    except (TypeError, ValueError):
        pass
    key = {**head, "seed": seed, "size": size, "index": index}
    key["answer"] = entry["answer"]  # for a reader of the logs; scoring uses the entry re-created
    return json.dumps(key, sort_keys=True, default=str)


class ReasoningGymSource(RowSource):
    """A reasoning-gym dataset: training entries reshuffled every epoch, held-out entries
    disjoint from them by question. Prompt ids are entry indices (of the training or the
    held-out dataset)."""

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
        rg = _reasoning_gym()
        self.name, self.kwargs = d.rg_dataset, _kwargs(cfg)
        check_dataset(self.name, self.kwargs)
        self.tokenizer = tokenizer
        check_tokenizer(cfg, tokenizer)
        if getattr(tokenizer, "chat_template", None) is None:
            where = getattr(tokenizer, "path", None) or "the tokenizer"
            raise ConfigError(
                f"{where}: no chat template; data.task = 'reasoning_gym' renders its prompts "
                f"(a system prompt, then the question) with one: use a tokenizer that has one"
            )
        self.system_prompt = rg.utils.SYSTEM_PROMPTS[SYSTEM_PROMPT]
        train_ds = _create(self.name, self.kwargs, d.seed, d.rg_train_size)
        eval_ds = _create(self.name, self.kwargs, d.rg_eval_seed, d.rg_eval_size)
        train = [train_ds[i] for i in range(d.rg_train_size)]
        questions = {e["question"] for e in train}
        held = [(i, eval_ds[i]) for i in range(d.rg_eval_size)]
        disjoint = [(i, e) for i, e in held if e["question"] not in questions]
        self.dropped = len(held) - len(disjoint)
        if not disjoint:
            raise ConfigError(
                f"data.rg_eval_size = {d.rg_eval_size}: every held-out entry of {self.name} "
                f"(data.rg_eval_seed = {d.rg_eval_seed}) is also a training question; the "
                f"dataset has too few distinct questions for data.rg_train_size = "
                f"{d.rg_train_size}: lower it or widen data.rg_config"
            )
        limit, why = prompt_limit(cfg)
        checks, self.rows, self.eval_rows = [], [], []
        for rows, seed, size, entries in (
            (self.rows, d.seed, d.rg_train_size, list(enumerate(train))),
            (self.eval_rows, d.rg_eval_seed, d.rg_eval_size, disjoint),
        ):
            check = LengthCheck(self.encode, limit, why, d.on_long_prompt, True)
            checks.append((check, seed))
            for i, entry in entries:
                row = Example(
                    entry["question"],
                    _answer(self.name, self.kwargs, seed, size, i, entry, d.rg_answer),
                    f"reasoning_gym {self.name} (seed {seed}) entry {i}",
                    {},
                    i,
                )
                if check(row):
                    rows.append(row)
        if not self.rows or not self.eval_rows:
            raise ConfigError(
                f"reasoning_gym {self.name}: every {'training' if not self.rows else 'held-out'} "
                f"prompt is over {limit} tokens ({why}; data.on_long_prompt: skip); raise "
                f"sampling.prompt_buckets or choose shorter problems"
            )
        shortest = min(c.shortest for c, _ in checks)
        longest = max(c.longest for c, _ in checks)
        notes = [
            f"data: reasoning_gym {self.name}: {len(self.rows)} training entries (seed "
            f"{d.seed}), {len(self.eval_rows)} held-out (seed {d.rg_eval_seed}; dropped "
            f"{self.dropped} whose question is a training one)"
        ]
        notes += [
            f"data: skipped {c.skipped} of {c.seen} reasoning_gym {self.name} entries (seed "
            f"{seed}): prompts over {limit} tokens ({why}; data.on_long_prompt: skip)"
            for c, seed in checks
            if c.skipped
        ]
        self._keep_run_settings(cfg, SCORE_SPEC, rounds_per_step, shard_index, num_shards)
        self._resolve_buckets(cfg, (shortest, longest, limit), notes, log)

    def encode(self, prompt: Prompt) -> list[int]:
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": prompt.text},
        ]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )


def data_identity(cfg: Config) -> dict[str, dict]:
    """What a checkpoint records of a reasoning-gym task, in the shape of a data file's
    identity: the dataset name as its ``path``, the training size, and the sha256 of the name,
    keyword arguments, sizes, seeds and the reasoning-gym version (the entries are a function of
    them)."""
    from importlib import metadata

    d = cfg.data
    try:
        version = metadata.version("reasoning-gym")
    except metadata.PackageNotFoundError:
        version = None
    key = {
        "dataset": d.rg_dataset,
        "config": _kwargs(cfg),
        "seed": d.seed,
        "train_size": d.rg_train_size,
        "eval_seed": d.rg_eval_seed,
        "eval_size": d.rg_eval_size,
        "reasoning_gym": version,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    path = f"reasoning_gym:{d.rg_dataset}"
    return {"data.rg_dataset": {"path": path, "size": d.rg_train_size, "sha256": digest}}


# --------------------------------------------------------------------------- the reward

_DATASETS: dict[str, Any] = {}  # in the reward worker: datasets by their creation key
_ENTRIES: dict[str, dict] = {}  # re-created entries by their answer string


def _dataset(name: str, kwargs: dict, seed: int = 0, size: int = 1):
    key = json.dumps([name, kwargs, seed, size], sort_keys=True)
    if key not in _DATASETS:
        _DATASETS[key] = _create(name, kwargs, seed, size)
    return _DATASETS[key]


def _entry(prompt: str, answer: str, spec: dict):
    """(dataset, entry) of a prompt's ``answer`` string (``spec``: it parsed); a re-created
    entry must have the prompt's question (the dataset is deterministic across processes)."""
    name, kwargs = spec["rg"], spec.get("config") or {}
    if "entry" in spec:
        return _dataset(name, kwargs), spec["entry"]
    dataset = _dataset(name, kwargs, spec["seed"], spec["size"])
    if answer not in _ENTRIES:
        if len(_ENTRIES) > 100_000:
            _ENTRIES.clear()
        _ENTRIES[answer] = dataset[spec["index"]]
    entry = _ENTRIES[answer]
    if entry["question"] != prompt:
        raise ValueError(
            f"reasoning-gym {name} entry {spec['index']} (seed {spec['seed']}) re-created in the "
            f"reward worker has another question than the prompt: the dataset is not "
            f"deterministic across processes"
        )
    return dataset, entry


try:  # a reward worker imports this module before its clock starts: reasoning-gym with it
    import reasoning_gym as _preload  # noqa: F401
except ImportError:  # without the extra: one line when a source or the reward needs it
    pass


def score(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """The reasoning-gym reward: per row, the dataset's ``score_answer`` of the completion's last
    ``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``), or with ``data.rg_answer:
    final`` and no tags, of its final answer (``math_checker.extract_answer``); 0.0 without
    one, or when ``score_answer`` raises on the model's answer. A malformed ``answers`` entry
    raises."""
    rg = _reasoning_gym()
    out = []
    for prompt, completion, answer in zip(prompts, completions, answers, strict=True):
        spec = json.loads(answer)
        dataset, entry = _entry(prompt, answer, spec)
        guess = rg.utils.extract_answer(completion)
        if guess is None and spec.get("extract") == "final":
            guess = final_answer(completion)
        if guess is None:
            out.append(0.0)
            continue
        try:
            value = float(dataset.score_answer(guess, entry))
        except Exception:  # the model's answer broke the verifier: a wrong answer
            value = 0.0
        out.append(value)
    return out
