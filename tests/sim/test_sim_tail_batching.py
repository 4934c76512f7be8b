"""The simulator with tail batching: the cut step by hand, its timing, and the deferred queue
(every prompt started is trained once, deferrals bounded)."""

import dataclasses

import numpy as np

from sagc_jax.config import Config, TailBatchingConfig
from sagc_jax.config.sim import SimConfig
from sagc_jax.controller import make_controller
from sagc_jax.sim import roofline
from sagc_jax.sim.runner import run_tail_batched, simulate_controller
from sagc_jax.sim.steptime import StepTimer
from sagc_jax.sim.workload import SyntheticWorkload

TIMER = StepTimer(SimConfig(hardware="custom"))


def test_cut_step_by_hand():
    lengths = np.array([[1, 2], [5, 1], [3, 3]])
    groups_r = np.repeat(np.arange(3), 2)
    stop, reached, done, kept = roofline.cut_step(lengths, groups_r, 2)
    # groups end at iterations 1, 4 and 2 (a rollout of length l started at 0 ends at l - 1)
    assert stop == 2 and kept.tolist() == [True, False, True]
    assert reached.tolist() == [1, 2, 3, 1, 3, 3]
    assert done.tolist() == [True, True, False, True, True, True]


def test_keeping_every_group_times_the_whole_step():
    lengths = np.random.default_rng(0).integers(1, 400, size=(8, 4))
    timer = TIMER
    whole = timer(lengths, 64)
    assert timer(lengths, 64, keep_groups=8) == whole
    cut = timer(lengths, 64, keep_groups=6)
    assert cut.compacting < whole.compacting and cut.update < whole.update


def test_uncut_simulation_is_unchanged_by_the_tail_path():
    sim = SimConfig(steps=6, prompts_per_step=8, hardware="custom")
    workload = SyntheticWorkload(sim)
    for t in range(sim.steps):
        np.testing.assert_array_equal(workload.lengths(t, 8), workload.lengths_at(t, t, 8))


def test_every_deferred_prompt_is_trained_once_and_waits_a_bounded_time():
    sim = SimConfig(steps=40, prompts_per_step=16, hardware="custom")
    cfg = Config()
    for every in (0, 3):
        tail = TailBatchingConfig(enabled=True, extra=0.25, long_round_every=every)
        ctrl = make_controller("sagc_plus", cfg.controller)
        run = run_tail_batched("sagc_plus", ctrl, SyntheticWorkload(sim), TIMER, tail)
        rec = run.tail
        groups = run.num_sequences / run.group_size
        long_groups = groups[rec["long_round"] == 1].sum()
        assert rec["deferred"].sum() == long_groups + rec["queue"][-1]
        # a normal step trains 16 of its 20 groups, a long round at most 16 deferred ones
        assert np.all(groups[rec["long_round"] == 0] == 20)
        assert np.all(groups[rec["long_round"] == 1] <= 16)
        assert rec["longest_deferral"] <= (4 if every == 0 else 3) + 1
        summary = run.summary()
        assert 0.0 < summary["deferred_share"] <= 0.2


def test_tail_batching_saves_modeled_time_on_the_calibrated_workload():
    sim = dataclasses.replace(SimConfig(hardware="custom"), steps=30, prompts_per_step=32)
    cfg = Config()
    plain = simulate_controller(
        "fixed:16", make_controller("fixed:16", cfg.controller), SyntheticWorkload(sim), TIMER
    )
    tail = run_tail_batched(
        "fixed:16",
        make_controller("fixed:16", cfg.controller),
        SyntheticWorkload(sim),
        TIMER,
        TailBatchingConfig(enabled=True),
    )
    assert tail.summary()["compacting_h"] < plain.summary()["compacting_h"]
