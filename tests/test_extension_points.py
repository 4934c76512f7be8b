"""The recipes of docs/architecture.md ("Where to add") followed once each: a toy controller,
reward, task source and loss aggregation (with the loss that uses it), each a class or function
and one entry in its table, in a temporary entry. Nothing else is edited: the config accepts
their names, docs/config.md would list them, and a simulated step (the controller) and a train
step (all four together) run with them."""

import json

import numpy as np
import pytest
from helpers import TINY

from sagc_jax.config import ConfigError, ControllerConfig, load_config
from sagc_jax.controller import GroupController
from sagc_jax.controller.registry import CONTROLLERS, ControllerEntry
from sagc_jax.planning.choices import TABLES, check_names, reference_markdown
from sagc_jax.rl.losses import AGGREGATIONS, ALGORITHMS, Aggregation, Algorithm
from sagc_jax.tasks import CharTokenizer
from sagc_jax.tasks.prompt_source import Prompt, PromptSource
from sagc_jax.tasks.rewards import REWARDS, Reward
from sagc_jax.tasks.source import SOURCES, SourceEntry, SyntheticSource


class SmallestController(GroupController):
    """A controller: always the smallest rung."""

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config.candidates, config.tau, config.scope)

    def _decide(self) -> int:
        return self.candidates[0]

    def _learn(self, group_size, s_t, lengths_pg, finished_pg=None):
        return {}


def shortness_reward(prompts, completions, answers):
    """A reward: shorter completions score higher."""
    return [1.0 / (1 + len(c)) for c in completions]


class RepeatingSource(SyntheticSource):
    """A task source: the synthetic task's first four problems, over and over."""

    def _train_prompt(self, position: int, step: int) -> Prompt:
        return super()._train_prompt(position % 4, 0)


TOYS = {
    "controller.kind": (
        "smallest",
        ControllerEntry(SmallestController, lambda c, _, __: SmallestController(c), "rung 0"),
    ),
    "data.reward": ("shortness", Reward(lambda **_: shortness_reward, "1 / (1 + length)")),
    "data.task": (
        "repeating",
        SourceEntry(
            RepeatingSource,
            lambda cfg, _tokenizer, *shard: RepeatingSource(cfg, *shard),
            lambda cfg: {},
            "four problems",
            tokenizer=CharTokenizer,  # its own, as the synthetic task's
        ),
    ),
    # a loss: DAPO's clip with a sum over each sequence's tokens, over the sequences
    "loss.algorithm": ("seq_sum", Algorithm("seq_sum", "seq_sum", True, "sum per sequence")),
}
OVERRIDES = [f"{key}={name}" for key, (name, _) in TOYS.items()]


@pytest.fixture
def toys(monkeypatch):
    """Every toy in its table for the test, and gone after it."""
    for key, (name, entry) in TOYS.items():
        monkeypatch.setitem(TABLES[key], name, entry)
    aggregation = Aggregation(per_sequence=False, share=lambda tokens_b, _: (tokens_b > 0) * 1.0)
    monkeypatch.setitem(AGGREGATIONS, "seq_sum", aggregation)
    assert issubclass(RepeatingSource, PromptSource)


def test_the_config_takes_each_new_name_and_the_reference_lists_it(toys):
    cfg = load_config(None, [*OVERRIDES, "sim.controllers=[smallest,fixed:4]"], check_names)
    assert (cfg.controller.kind, cfg.data.reward, cfg.data.task) == (
        "smallest",
        "shortness",
        "repeating",
    )
    page = reference_markdown()
    for name, entry in (toy for toy in TOYS.values()):
        assert f"`{name}`" in page and f"{name}: {entry.help}" in page


def test_without_its_entry_a_name_is_refused_naming_the_allowed_ones():
    for override in OVERRIDES:
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=f"--set {override}: {key} = .* choose one of"):
            load_config(None, [override], check_names)
    assert "smallest" not in CONTROLLERS and "seq_sum" not in ALGORITHMS
    assert "shortness" not in REWARDS and "repeating" not in SOURCES


def test_a_simulated_step_with_the_new_controller(toys):
    from sagc_jax.planning.timing import step_timer
    from sagc_jax.sim.runner import compare
    from sagc_jax.sim.workload import SyntheticWorkload

    cfg = load_config(None, ["sim.steps=1", "sim.controllers=[smallest]"], check_names)
    timer = step_timer(cfg, cfg.sim.prompt_tokens + cfg.sim.max_new_tokens)
    (run,) = compare(cfg, SyntheticWorkload(cfg.sim), timer)
    assert run.group_size.tolist() == [min(cfg.controller.candidates)]


def test_a_train_step_with_every_new_kind(toys, tmp_path):
    from sagc_jax.train.loop import Trainer

    overrides = [*TINY, *OVERRIDES, "train.steps=1", "logging.tensorboard=false"]
    trainer = Trainer(load_config(None, overrides, check_names), tmp_path / "run")
    assert isinstance(trainer.source, RepeatingSource)
    assert trainer.source.reward_fn is shortness_reward
    trainer.run(progress=False)
    trainer.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (step,) = [record for record in map(json.loads, lines) if "group_size" in record]
    assert step["group_size"] == 2  # the smallest rung of TINY's ladder
    assert 0 < step["reward"] <= 1 and np.isfinite(step["reward"])
