"""Controllers reading cut steps (tail batching): censored groups by hand, the uncut path
unchanged, and the straggler budget kept on the oracle worlds with every step cut."""

import numpy as np
import pytest

from sagc_jax.config import ControllerConfig, SAGCConfig
from sagc_jax.controller import (
    FixedGroupController,
    SAGCController,
    SAGCPlusController,
    StepObservation,
)
from sagc_jax.controller.observation import censored_observation, censored_straggle

TAU = 3.0


def cut_groups(rng, num_groups, group_size, keep):
    """Tail lengths ``[P, G]`` (100 or 1000 tokens, q = 0.1) cut once ``keep`` groups are
    whole (every rollout starts at once): ``(full, reached, finished)``."""
    scale_p = rng.integers(50, 400, size=(num_groups, 1))
    full = np.where(rng.random((num_groups, group_size)) < 0.1, 10, 1) * scale_p
    stop = np.sort(full.max(axis=1))[keep - 1]
    return full, np.minimum(full, stop), full <= stop


# ---------------------------------------------------------------- by hand


def test_a_certain_straggler_and_an_unknown_group_by_hand():
    lengths = np.array([[10, 10, 10, 40], [10, 10, 25, 25], [5, 6, 7, 8]])
    finished = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    straggle, ratio, censored, certain = censored_straggle(lengths, finished, TAU)
    # group 0: median bound (10 + 10) / 2 with the cut rollout at +inf, 40 / 10 > 3: certain
    # group 1: half the rollouts cut, the median bound is infinite: unknown
    assert ratio[0] == 4.0 and ratio[1] == 0.0 and ratio[2] == 8 / 6.5
    assert censored.tolist() == [True, True, False] and certain.tolist() == [True, False, False]
    assert straggle[0] == 1.0 and straggle[2] == 0.0
    assert 0.0 < straggle[1] <= 1.0  # unknown: never read as safe
    s_t, _, counts = censored_observation(lengths, finished, TAU, "group")
    assert s_t == pytest.approx(straggle.mean())
    assert counts == {"censored_groups": 2, "censored_stragglers": 1, "censored_unknown": 1}


def test_unknown_group_with_nothing_to_fit_counts_as_a_straggler():
    lengths = np.array([[10, 10, 25, 25]])
    finished = np.array([[1, 1, 0, 0]], bool)
    assert censored_straggle(lengths, finished, TAU)[0][0] == 1.0


def test_batch_scope_reads_the_step_as_one_group():
    lengths = np.array([[10, 10], [10, 50]])
    finished = np.array([[1, 1], [1, 0]], bool)
    s_t, _, _ = censored_observation(lengths, finished, TAU, "batch")
    assert s_t == 1.0  # 50 / median 10 > 3 already


@pytest.mark.parametrize("kind", ["fixed", "sagc", "sagc_plus"])
def test_uncut_steps_read_as_before(kind):
    """finished None and all True: the same decisions and the same metrics (the censored
    counts, 0, added only when finished is passed)."""

    def make():
        if kind == "fixed":
            return FixedGroupController(8)
        if kind == "sagc":
            return SAGCController(ControllerConfig(delta=0.2), SAGCConfig(seed=3))
        return SAGCPlusController(ControllerConfig(delta=0.2))

    a, b = make(), make()
    rng = np.random.default_rng(0)
    for _ in range(30):
        g = a.propose()
        assert b.propose() == g
        lengths = np.where(rng.random((16, g)) < 0.05, 1000, 100)
        ma = a.observe(StepObservation.of_groups(lengths))
        mb = b.observe(StepObservation.of_groups(lengths, np.ones_like(lengths, bool)))
        assert mb.pop("censored_groups") == mb.pop("censored_stragglers") == 0
        assert mb.pop("censored_unknown") == 0
        assert ma.keys() == mb.keys()
        for key in ma:
            np.testing.assert_array_equal(ma[key], mb[key])


def test_fixed_g_accepts_cut_steps_and_reports_them():
    ctrl = FixedGroupController(8)
    full, reached, finished = cut_groups(np.random.default_rng(1), 20, 8, keep=16)
    assert ctrl.propose() == 8
    m = ctrl.observe(StepObservation.of_groups(reached, finished))
    assert m["censored_groups"] == int((~finished.all(axis=1)).sum()) >= 4
    assert m["censored_stragglers"] + m["censored_unknown"] == m["censored_groups"]


def test_sagc_plus_reads_cut_chunks_of_smaller_rungs():
    ctrl = SAGCPlusController(ControllerConfig(delta=0.2, g_init=16))
    _, reached, finished = cut_groups(np.random.default_rng(2), 20, 16, keep=16)
    straggled, trials = ctrl.trials_by_rung(reached, 0.3, finished)
    assert trials.tolist() == [20, 20, 20] and straggled[-1] == pytest.approx(6.0)
    assert np.all(straggled[:2] >= 0) and np.all(straggled[:2] <= 20)


def test_finished_of_another_shape_is_rejected():
    ctrl = FixedGroupController(4)
    ctrl.propose()
    with pytest.raises(ValueError, match="finished must be a bool array"):
        ctrl.observe(StepObservation.of_groups(np.ones((2, 4), int), np.ones((2, 3), bool)))


# ---------------------------------------------------------------- the budget, every step cut


def excess(world, spec, delta, keep, seed):
    """Straggler rate (true, of every group started) over the oracle's allowed rate, after
    10 steps; spec ``sagc_plus`` or ``naive`` (the cut lengths read as complete)."""
    from sagc_jax.sim.worlds import oracle, play_cut, rates_table

    ctrl = SAGCPlusController(ControllerConfig(delta=delta))
    _, s_t, _ = play_cut(ctrl, world, keep, naive=spec == "naive")
    best = oracle(rates_table(world), world.candidates, delta)
    return s_t[10:].mean() - best["allowed"][10:].mean()


WORLDS = {
    "steady": lambda t: 0.04,
    "heavy_tail": lambda t: 0.2,
    "drift_up": lambda t: 0.005 + 0.075 * t / 79,
    "shift_down": lambda t: 0.1 if t < 40 else 0.01,
}


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_sagc_plus_keeps_its_budget_with_every_step_cut(name):
    """A slice of ``controller_quality.py --tail-batching``: 80 of 64 groups kept, 80 steps."""
    from sagc_jax.sim.worlds import TailWorld

    for delta in (0.2, 0.3):
        values = [
            excess(TailWorld(WORLDS[name], 80, prompts_per_step=80, seed=s), "plus", delta, 64, s)
            for s in range(2)
        ]
        assert np.mean(values) <= 0.03, (name, delta, values)


def test_reading_unknown_groups_as_safe_breaks_the_budget():
    from sagc_jax.sim.worlds import TailWorld

    values = [
        excess(TailWorld(WORLDS["drift_up"], 80, prompts_per_step=80, seed=s), "naive", 0.2, 64, s)
        for s in range(2)
    ]
    assert np.mean(values) > 0.03
