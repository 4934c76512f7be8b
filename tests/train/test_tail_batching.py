"""On-policy tail batching (``tail_batching``): the deferred queue's accounting, whole groups
kept, every started prompt trained once, exact resume with prompts waiting."""

import chex
import numpy as np
import pytest
from helpers import TINY

from sagc_jax.config import ConfigError, TailBatchingConfig, load_config
from sagc_jax.programs.tail import TailBatcher
from sagc_jax.tasks.prompt_source import Prompt
from sagc_jax.train.loop import Trainer


class CountingSource:
    """Prompt i is position i (one shard)."""

    def positions(self, first, num_prompts):
        return list(range(first, first + num_prompts))

    def prompt_at(self, position, step):
        return Prompt(f"p{position}", "", position)


@pytest.mark.parametrize("every", [0, 3])
def test_every_started_prompt_is_trained_once_and_none_waits_long(every):
    """Random cuts over 200 steps: the trained prompts and the queue are exactly the positions
    started, each once; a prompt waits a bounded number of steps; long rounds keep the queue
    under a step's worth."""
    rng = np.random.default_rng(0)
    tail = TailBatcher(TailBatchingConfig(True, 0.5, every), processes=1)
    source, trained, waits = CountingSource(), [], []
    for step in range(200):
        round_ = tail.next_round(source, step, 4)
        cut_p = np.zeros(len(round_.prompts), bool)
        if not round_.long:  # 6 started, at least 4 whole
            cut_p[rng.choice(6, size=rng.integers(0, 3), replace=False)] = True
        kept = tail.settle(round_, cut_p, step)
        waits.append(tail.last["waited"])
        assert len(kept) == 4 and not cut_p[kept].any()
        trained += [round_.prompts[i].id for i in kept]
        assert len(tail.queue) < 4 + 2
    queued = [e.position for e in tail.queue]
    assert sorted(trained + queued) == list(range(tail.cursor))
    assert tail.long_rounds > 0 and max(waits) <= (3 if every else 4)


def test_settle_refuses_fewer_whole_groups_than_promised():
    tail = TailBatcher(TailBatchingConfig(True, 0.5, 0), processes=1)
    round_ = tail.next_round(CountingSource(), 0, 2)
    with pytest.raises(RuntimeError, match="1 whole groups"):
        tail.settle(round_, np.array([True, True, False]), 0)


def test_tail_batching_refuses_what_it_does_not_combine_with():
    with pytest.raises(ConfigError, match="tail_batching.enabled = true does not combine"):
        load_config(None, ["tail_batching.enabled=true", "loss.dynamic_sampling=true"])


TAIL = [
    *TINY,
    "tail_batching.enabled=true",
    "tail_batching.extra=0.5",  # 2 prompts a step: 1 more started, a long round every third
    "controller.kind=fixed",
    "controller.group_size=4",
    "logging.tensorboard=false",
]


@pytest.mark.slow
def test_a_tail_step_trains_whole_groups_and_every_prompt_once(tmp_path):
    trainer = Trainer(load_config(None, [*TAIL, "train.steps=6"]), tmp_path / "run")
    trained, kinds = [], []
    for _ in range(6):
        step = trainer.train_step()
        trainer.step_log(step)  # a tail step makes its metrics line
        assert step.batch.cut is None or not step.batch.cut.any()  # whole groups only
        assert len(step.batch.prompts) == 2 and step.batch.group_sizes.tolist() == [4, 4]
        trained += [p.id for p in step.batch.prompts]
        kinds.append(trainer.tail.last["long"])
        assert step.rounds[0].cut is not None or kinds[-1]
    trainer.close()
    queued = [e.position for e in trainer.tail.queue]
    assert sorted(trained + queued) == list(range(trainer.tail.cursor))
    assert kinds == [0, 0, 1, 0, 0, 1]  # 1 deferred a tail step: 2 wait after two
    assert trainer.sampler.num_traces == 2  # the tail step's program and the long round's


@pytest.mark.slow
def test_resume_with_prompts_waiting_continues_exactly(tmp_path):
    straight = Trainer(load_config(None, [*TAIL, "train.steps=5"]), tmp_path / "straight")
    straight.run(progress=False)
    straight.close()
    first = Trainer(
        load_config(None, [*TAIL, "train.steps=2", "train.checkpoint_every=2"]),
        tmp_path / "resumed",
    )
    first.run(progress=False)
    first.close()
    assert len(first.tail.queue) == 2  # waiting at the checkpoint
    second = Trainer(load_config(None, [*TAIL, "train.steps=5"]), tmp_path / "resumed")
    assert second.step == 2 and second.tail.queue == first.tail.queue
    second.run(progress=False)
    second.close()
    chex.assert_trees_all_equal(second.state.params, straight.state.params)
    chex.assert_trees_all_equal(second.controller.state_dict(), straight.controller.state_dict())
    assert second.tail.queue == straight.tail.queue and second.tail.cursor == straight.tail.cursor


def test_a_tail_step_the_mesh_cannot_split_is_refused_before_the_run():
    from sagc_jax.programs.shapes import check_batch_shapes

    cfg = load_config(None, [*TAIL, "train.prompts_per_step=4", "tail_batching.extra=0.25"])
    with pytest.raises(ConfigError, match="a tail step starts 5 prompts"):
        check_batch_shapes(cfg, (1, 2), batch_shards=2)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_without_tail_batching_a_step_draws_the_positions_it_always_did(shards):
    """``batch`` (the path with tail batching off) still draws shard i's slice of positions
    (step x rounds + round) x P ..., and ``positions`` / ``prompt_at`` give the same prompts."""
    from sagc_jax.tasks.source import SyntheticSource

    cfg = load_config(None, TINY)
    for shard in range(shards):
        source = SyntheticSource(cfg, rounds_per_step=2, shard_index=shard, num_shards=shards)
        num, local = 6 * shards, 6
        for step, round_ in [(0, 0), (3, 1)]:
            first = (step * 2 + round_) * num + shard * local  # the formula before #32
            want = [source._train_prompt(first + i, step) for i in range(local)]
            assert source.batch(step, round_, num) == want
            positions = source.positions((step * 2 + round_) * num, num)
            assert [source.prompt_at(p, step) for p in positions] == want
