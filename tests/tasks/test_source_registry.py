"""The prompt-source registry: one entry per ``data.task`` choice, and ``make_source`` and
``data_identity`` go through it (a source is one module and one entry: docs/architecture.md,
"Add a task source")."""

import dataclasses

from sagc_jax.config import DataConfig, load_config
from sagc_jax.planning.choices import TABLES
from sagc_jax.tasks.prompt_source import PromptSource
from sagc_jax.tasks.source import SOURCES, SourceEntry, data_identity, make_source


def test_data_task_reads_its_choices_from_the_registry():
    (task,) = [f for f in dataclasses.fields(DataConfig) if f.name == "task"]
    assert task.metadata["named"] and TABLES["data.task"] is SOURCES
    assert all(issubclass(entry.cls, PromptSource) for entry in SOURCES.values())


class CountingSource(PromptSource):
    """A toy source: prompts are their own position."""

    def __init__(self, cfg, tokenizer, rounds_per_step, shard_index, num_shards, log):
        self._keep_run_settings(cfg, "synthetic", rounds_per_step, shard_index, num_shards)
        self._resolve_buckets(cfg, (4, 9, 64), [], log)
        self.tokenizer = tokenizer

    def _train_prompt(self, position, step):
        from sagc_jax.tasks.prompt_source import Prompt

        return Prompt(str(position), str(position), position)


def test_make_source_and_the_identity_go_through_the_entry(monkeypatch):
    identity = {"data.toy": {"path": "toy", "size": 0, "sha256": ""}}
    entry = SourceEntry(CountingSource, CountingSource, lambda cfg: identity, "positions")
    monkeypatch.setitem(SOURCES, "synthetic", entry)
    cfg = load_config(None, ["sampling.prompt_buckets=auto", "train.prompts_per_step=4"])
    said = []
    source = make_source(cfg, tokenizer="tok", shard_index=1, num_shards=2, log=said.append)
    assert isinstance(source, CountingSource) and source.tokenizer == "tok"
    assert source.prompt_buckets == (8, 16) and said == []  # the first shard says the notes
    assert [p.id for p in source.batch(step=1, round_=0, num_prompts=4)] == [6, 7]
    assert data_identity(cfg) == identity
