"""StepObservation: what a step tells every controller's observe() (numpy)."""

import numpy as np
import pytest

from sagc_jax.config import ControllerConfig, HybridConfig
from sagc_jax.controller import (
    FixedGroupController,
    HybridController,
    StepObservation,
    make_controller,
)


def test_every_layout_gives_the_same_flat_arrays():
    groups = [np.array([3, 1, 4]), np.array([1, 5]), np.array([9, 2, 6, 5])]
    sizes = np.array([3, 2, 4])
    flat = np.concatenate(groups)
    rewards = [np.array([1.0, 0.0, 1.0]), np.array([0.0, 0.0]), np.array([1.0, 1.0, 0.0, 1.0])]
    padded, padded_rewards = np.full((3, 4), -1), np.full((3, 4), np.nan)
    for p, (g, r) in enumerate(zip(groups, rewards, strict=True)):
        padded[p, : g.size], padded_rewards[p, : r.size] = g, r
    forms = [
        StepObservation.of_rollouts(groups, rewards=rewards),
        StepObservation.of_rollouts(flat, sizes, rewards=np.concatenate(rewards)),
        StepObservation.of_rollouts(padded, sizes, rewards=padded_rewards),
        StepObservation(flat.astype(np.int32), sizes, rewards_b=np.concatenate(rewards)),
    ]
    for obs in forms:
        np.testing.assert_array_equal(obs.lengths_b, flat)
        np.testing.assert_array_equal(obs.sizes_p, sizes)
        np.testing.assert_array_equal(obs.rewards_b, np.concatenate(rewards))
        assert obs.lengths_b.dtype == obs.sizes_p.dtype == np.int64
        assert obs.group_size is None and obs.num_groups == 3 and not obs.cut
    with pytest.raises(ValueError, match="mixed sizes"):
        forms[0].lengths_pg()


def test_one_g_views():
    lengths = np.arange(12).reshape(3, 4)
    finished = np.ones((3, 4), bool)
    obs = StepObservation.of_groups(lengths, finished, lengths / 10.0, prompt_ids=[7, 8, 9])
    assert obs.group_size == 4 and obs.sizes_p.tolist() == [4, 4, 4]
    np.testing.assert_array_equal(obs.lengths_pg(expected_group_size=4), lengths)
    np.testing.assert_array_equal(obs.finished_pg, finished)
    np.testing.assert_array_equal(obs.rewards_pg, lengths / 10.0)
    assert obs.prompt_ids_p.tolist() == [7, 8, 9] and obs.prompt_ids_p.dtype == np.int64
    assert not obs.cut  # finished given, all True
    with pytest.raises(ValueError, match="group size 4 .* proposed G=8"):
        obs.lengths_pg(expected_group_size=8)
    finished[1, 2] = False
    assert StepObservation.of_groups(lengths, finished).cut


def test_bad_fields_are_rejected_with_their_name():
    with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
        StepObservation.of_groups(np.ones(8, int))
    with pytest.raises(ValueError, match=">= 0"):
        StepObservation.of_groups(-np.ones((2, 4), int))
    with pytest.raises(ValueError, match="integer"):
        StepObservation.of_groups(np.full((2, 4), 1.5))
    with pytest.raises(ValueError, match="finished must be a bool array"):
        StepObservation.of_groups(np.ones((2, 4), int), np.ones((2, 4), int))
    with pytest.raises(ValueError, match="rewards_pg has shape"):
        StepObservation.of_groups(np.ones((2, 4), int), rewards_pg=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="do not match the lengths"):
        StepObservation(np.ones(6, np.int64), np.array([3, 3]), rewards_b=np.zeros(5))
    with pytest.raises(ValueError, match="prompt_ids must be an integer array"):
        StepObservation.of_groups(np.ones((2, 4), int), prompt_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="do not match group_sizes"):
        StepObservation(np.ones(7, np.int64), np.array([4, 4]))


def test_observe_takes_only_an_observation():
    ctrl = FixedGroupController(4)
    ctrl.propose()
    with pytest.raises(TypeError, match="StepObservation.of_groups"):
        ctrl.observe(np.ones((2, 4), int))
    mixed = StepObservation.of_rollouts(np.ones(8, int), [4, 2, 2])
    with pytest.raises(ValueError, match="mixed sizes"):
        ctrl.observe(mixed)
    assert ctrl.observe(StepObservation.of_groups(np.ones((2, 4), int)))["group_size"] == 4


def test_the_hybrid_refuses_a_cut_step_and_only_it_has_a_calibration():
    ctrl = HybridController(ControllerConfig(), HybridConfig(mode="step"))
    g = ctrl.propose_for(np.arange(2))
    finished = np.ones((2, g), bool)
    finished[0, 0] = False
    with pytest.raises(ValueError, match="cut by tail batching"):
        ctrl.observe(StepObservation.of_groups(np.ones((2, g), int), finished))
    assert ctrl.observe(StepObservation.of_groups(np.ones((2, g), int)))["step"] == 0
    assert ctrl.calibration()["groups"] == 2
    for spec in ("fixed:4", "sagc", "sagc_plus", "sagc_value"):
        assert make_controller(spec, ControllerConfig()).calibration() is None
